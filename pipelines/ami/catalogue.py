"""AMI's ten pipelines as ``ami worker`` (AMI Data Companion) runs and registers them, as data.

Every pipeline: AMI's 2023 Faster R-CNN (ResNet-50 FPN) detector, boxes scored strictly over
0.8 and truncated to whole pixels; for species pipelines the moth / non-moth classifier as a
filter (crops it labels ``moth`` go on); then the slug's classifier. ``moth_binary`` and
``insect_orders_2025`` have no filter. Crops are cut from the full image and squashed to the
classifier's input with an antialiased bilinear resize of their float pixels (``resize_in``),
as ``ami worker`` does. Names, keys (AMI's ``get_key()``), descriptions, URIs and taxon ranks
are AMI's, registered verbatim. ``files_mirror`` replaces ``AMI_BASE`` in every file URL.

AMI's files are named under ``AMI_BASE`` (the URIs registered and cached) and downloaded from
``FILE_HOSTS`` in turn (``file_hosts``); the sizes are those AMI's model cards publish
(docs/model-files.md says where each fact comes from). The 8 hex digits some names end with
are names, not digests: nothing shows they are part of a sha256, so they are not checked.

A new AMI pipeline is one more ``_Row`` in ``_ROWS`` (docs/replacing-ami-worker.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipelines.declare import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Classifier,
    Detector,
    Pipeline,
    Preprocess,
    Registered,
)
from pipelines.files.hosts import Hosts

AMI_BASE = "https://object-arbutus.cloud.computecanada.ca/ami-models/"
AMI_CURRENT_BASE = (
    "https://object-arbutus.alliancecan.ca/swift/v1/AUTH_3c987b8fc90743469d42899b1fdb48eb/"
    "ami-models/"
)
FILE_HOSTS = (AMI_CURRENT_BASE, AMI_BASE)  # AMI's current host first, the old one after
_CLASSIFICATION = "moths/classification/"
HALF = (0.5, 0.5, 0.5)
STATE_DICT_ENTRY = "model_state_dict"  # AMI unwraps it where a checkpoint has it


@dataclass(frozen=True)
class _Model:
    """One of AMI's models: its identity, files (relative to ``AMI_BASE``) and layout."""

    name: str
    key: str  # AMI's get_key(): its name slugified
    description: str
    weights: str
    labels: str | None
    architecture: str
    size: int = 128
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    taxon_rank: str = "SPECIES"
    weights_bytes: int | None = None  # the size AMI's model card publishes, where it does
    classes: int | None = None  # the published category map's size, where AMI states it


DETECTOR = _Model(
    "FasterRCNN for AMI Moth Traps 2023",
    "fasterrcnn_for_ami_moth_traps_2023",
    "Model trained on GBIF images and synthetic data in 2023. "
    "Accurate but can be slow on a machine without GPU.",
    "moths/localization/fasterrcnn_resnet50_fpn_tz53qv9v.pt",
    None,
    "fasterrcnn_resnet50_fpn",
    weights_bytes=330_066_092,
)
DETECTOR_SCORE_THRESHOLD = 0.8
DETECTOR_MAX_DETECTIONS = 500
BINARY = _Model(
    "Moth / Non-Moth Classifier",
    "moth_nonmoth_classifier",
    "Trained on April 17, 2024",
    _CLASSIFICATION + "moth-nonmoth_resnet50_20240417_b4fe3efe.pth",
    _CLASSIFICATION + "05-moth-nonmoth_category_map.json",
    "resnet50",
    taxon_rank="SUPERFAMILY",
    weights_bytes=94_373_731,
    classes=2,
)
KEEP = ("moth",)  # the binary classifier's positive label


def _timm_resnet50(
    name: str, key: str, what: str, run: str, weights: tuple[str, int], labels: str
) -> _Model:
    """``what``: "<date> for <n> species", as AMI's description says it; ``weights``: the
    file's name and published size."""
    return _Model(
        name,
        key,
        f"Trained on {what}. https://wandb.ai/moth-ai/{run}/overview",
        _CLASSIFICATION + weights[0],
        _CLASSIFICATION + labels,
        "timm/resnet50",
        weights_bytes=weights[1],
        classes=int(what.split(" for ")[1].split()[0].replace(",", "")),
    )


def _turing(region: str, key: str, date: str, weights: str, labels: str) -> _Model:
    return _Model(
        f"Turing {region} Species Classifier",
        key,
        f"Trained on {date} by Turing team using Resnet50 model.",
        _CLASSIFICATION + weights,
        _CLASSIFICATION + labels,
        "ami_resnet50",
        size=300,
        mean=HALF,
        std=HALF,
    )


@dataclass(frozen=True)
class _Row:
    slug: str
    classifier: _Model
    filtered: bool = True  # the moth / non-moth filter runs first


_ROWS = (
    _Row(
        "panama_moths_2023",
        _Model(
            "Panama Species Classifier 2023",
            "panama_species_classifier_2023",
            "Trained on November 11th, 2023 using a corrected species list of 1060 classes.",
            _CLASSIFICATION + "panama_resetnet50_best_5aeb515a.pth",
            _CLASSIFICATION + "03_moths_centralAmerica_category_map-202311110-with-names.json",
            "resnet50",
            classes=1060,
        ),
    ),
    _Row(
        "panama_moths_2024",
        _timm_resnet50(
            "Panama Species Classifier - Apr 2024",
            "panama_species_classifier_apr_2024",
            "April 17, 2024 for 636 species",
            "ami-gbif-fine-grained/runs/1sekgkan",
            ("panama_resnet50_baseline_20240417_edbb46dd.pth", 99_570_019),
            "03_ami-gbif_fine-grained_c-america_category_map-with_names.json",
        ),
    ),
    _Row(
        "quebec_vermont_moths_2023",
        _timm_resnet50(
            "Quebec & Vermont Species Classifier - Apr 2024",
            "quebec_vermont_species_classifier_apr_2024",
            "April 17, 2024 for 2,497 species",
            "ami-gbif-fine-grained/runs/1x53zmp2",
            ("quebec-vermont_resnet50_baseline_20240417_950de764.pth", 114_822_755),
            "01_ami-gbif_fine-grained_ne-america_category_map-with_names.json",
        ),
    ),
    _Row(
        "uk_denmark_moths_2023",
        _timm_resnet50(
            "UK & Denmark Species Classifier - Apr 2024",
            "uk_denmark_species_classifier_apr_2024",
            "April 17, 2024 for 2,603 species",
            "ami-gbif-fine-grained/runs/x5u7jcbf",
            ("uk-denmark_resnet50_baseline_20240417_55250a8b.pth", 115_691_491),
            "02_ami-gbif_fine-grained_w-europe_category_map-with_names.json",
        ),
    ),
    _Row(
        "costa_rica_moths_turing_2024",
        _turing(
            "Costa Rica",
            "turing_costa_rica_species_classifier",
            "4th June 2024",
            "turing-costarica_v03_resnet50_2024-06-04-16-17_state.pt",
            "03_costarica_data_category_map.json",
        ),
    ),
    _Row(
        "anguilla_moths_turing_2024",
        _turing(
            "Anguilla",
            "turing_anguilla_species_classifier",
            "28th June 2024",
            "turing-anguilla_v01_resnet50_2024-06-28-17-01_state.pt",
            "01_anguilla_data_category_map.json",
        ),
    ),
    _Row(
        "kenya-uganda_moths_turing_2024",
        _turing(
            "Kenya and Uganda",
            "turing_kenya_and_uganda_species_classifier",
            "19th November 2024",
            "turing-kenya-uganda_v01_resnet50_2024-11-19-18-44_state.pt",
            "01_kenya-uganda_data_category_map.json",
        ),
    ),
    _Row(
        "global_moths_2024",
        _timm_resnet50(
            "Global Species Classifier - Aug 2024",
            "global_species_classifier_aug_2024",
            "August 28th, 2024 for 29,176 species",
            "global-moth-classifier/runs/h0cuqrbc",
            ("global_resnet50_20240828_b06d3b3a.pth", 333_489_027),
            "global_category_map_with_names_20240828.json",
        ),
    ),
    _Row("moth_binary", BINARY, filtered=False),
    _Row(
        "insect_orders_2025",
        _Model(
            "Insect Order Classifier",
            "insect_order_classifier",
            "ConvNeXt-T based insect order classifier for 16 classes trained by Mila in "
            "January 2025",
            "insect_orders/convnext_tiny_in22k_worder0.5_wbinary0.5_run2_checkpoint.pt",
            "insect_orders/insect_order_category_map.json",
            "timm/convnext_tiny_in22k",
            taxon_rank="ORDER",
            weights_bytes=334_241_031,
            classes=16,
        ),
        filtered=False,
    ),
)
SLUGS = tuple(row.slug for row in _ROWS)


def published_sizes() -> dict[str, int]:
    """The size in bytes of each file AMI publishes one for, by its path under the base."""
    models = (DETECTOR, BINARY, *(row.classifier for row in _ROWS))
    return {m.weights: m.weights_bytes for m in models if m.weights_bytes is not None}


def file_hosts(files_mirror: str, hosts: tuple[str, ...], published: bool) -> Hosts:
    """Where AMI's files are downloaded from: the mirror alone when one is set, else
    ``hosts`` in turn (empty: ``FILE_HOSTS``); with ``published``, the sizes AMI states."""
    sizes = published_sizes() if published else {}
    if files_mirror:
        base = files_mirror.rstrip("/") + "/"
        if "://" not in base:
            base = "file://" + os.path.abspath(base) + "/"  # as the stages' URIs are read
        return Hosts(base, (base,), sizes)
    return Hosts(AMI_BASE, hosts or FILE_HOSTS, sizes)


def mirrored(relative: str, files_mirror: str) -> str:
    """A file's URI: ``AMI_BASE`` + ``relative``, or the mirror's base + ``relative``."""
    if not files_mirror:
        return AMI_BASE + relative
    return files_mirror.rstrip("/") + "/" + relative


def _registered(model: _Model) -> Registered:
    return Registered(
        key=model.key,
        description=model.description,
        uri=AMI_BASE + model.weights,
        labels_uri=AMI_BASE + model.labels if model.labels else None,
        taxon_rank=model.taxon_rank,
    )


def _detector(files_mirror: str) -> Detector:
    return Detector(
        key=DETECTOR.key,
        name=DETECTOR.name,
        architecture=DETECTOR.architecture,
        weights=mirrored(DETECTOR.weights, files_mirror),
        labels=("object",),  # one class and the background
        score_threshold=DETECTOR_SCORE_THRESHOLD,
        max_detections=DETECTOR_MAX_DETECTIONS,
        whole_pixel_boxes=True,
        full_size=True,  # detected at the image's own size, as ami worker detects it
        frozen_batch_norms=True,  # AMI builds it with a pretrained backbone: frozen norms
        sizes_apart=True,  # boxes independent of batch-mates, as AMI's detector gives alone
        checkpoint_entry=STATE_DICT_ENTRY,
        registered=_registered(DETECTOR),
    )


def _classifier(model: _Model, files_mirror: str, keep: tuple[str, ...] = ()) -> Classifier:
    assert model.labels is not None
    return Classifier(
        key=model.key,
        name=model.name,
        architecture=model.architecture,
        weights=mirrored(model.weights, files_mirror),
        labels=mirrored(model.labels, files_mirror),
        preprocess=Preprocess(model.size, "squash", model.mean, model.std, resize_in="float"),
        keep=keep,
        dropped_terminal=not keep,  # ami worker: the filter's label is never terminal
        checkpoint_entry=STATE_DICT_ENTRY,
        registered=_registered(model),
    )


def _row(slug: str) -> _Row:
    return {r.slug: r for r in _ROWS}[slug]


def model_of(slug: str) -> _Model:
    """The classifier ``slug``'s pipeline ends with."""
    return _row(slug).classifier


def pipeline(slug: str, files_mirror: str = "") -> Pipeline:
    """The pipeline ``slug`` names (one of ``SLUGS``); KeyError for another. Its files are
    AMI's URIs (or the mirror's), with no digest declared: each is pinned as ``recorded``
    (or by the operator's verified sha256), its size checked by ``file_hosts``'s sizes."""
    row = _row(slug)
    return Pipeline(
        name=row.slug,
        title=row.classifier.name,
        description=row.classifier.description,
        version=1,
        detector=_detector(files_mirror),
        filter=_classifier(BINARY, files_mirror, KEEP) if row.filtered else None,
        classifier=_classifier(row.classifier, files_mirror),
    )
