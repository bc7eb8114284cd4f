"""AMI's catalogue: every slug's stages as AMI's worker runs them, the module layouts its
checkpoints were saved from, its category maps, the crop preprocessing against torchvision's
transforms, its Antenna identities, and stages shared between pipelines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from config.errors import ConfigError
from datasets.uris import SourceConfig
from pipelines import shared
from pipelines.ami import catalogue, layouts
from pipelines.ami.category_map import labels_of
from pipelines.architectures import build_classifier
from pipelines.declare import IMAGENET_MEAN, IMAGENET_STD, problems
from pipelines.models import Algorithm, ClassifierModel
from pipelines.registry import CATALOGUE, resolve
from pipelines.runner import _squared
from tests.ami_files import (
    BINARY_MAP,
    SPECIES,
    classifier_state,
    labels_by_index,
    species_map,
)
from worker.antenna.render import AntennaPipeline, antenna_key

BASE = "https://object-arbutus.cloud.computecanada.ca/ami-models/"
HALF = (0.5, 0.5, 0.5)
IMAGENET = (IMAGENET_MEAN, IMAGENET_STD)
# slug: (classifier architecture, input side, (mean, std), filtered, AMI key, taxon rank)
EXPECTED = {
    "panama_moths_2023": (
        "resnet50",
        128,
        IMAGENET,
        True,
        "panama_species_classifier_2023",
        "SPECIES",
    ),
    "panama_moths_2024": (
        "timm/resnet50",
        128,
        IMAGENET,
        True,
        "panama_species_classifier_apr_2024",
        "SPECIES",
    ),
    "quebec_vermont_moths_2023": (
        "timm/resnet50",
        128,
        IMAGENET,
        True,
        "quebec_vermont_species_classifier_apr_2024",
        "SPECIES",
    ),
    "uk_denmark_moths_2023": (
        "timm/resnet50",
        128,
        IMAGENET,
        True,
        "uk_denmark_species_classifier_apr_2024",
        "SPECIES",
    ),
    "costa_rica_moths_turing_2024": (
        "ami_resnet50",
        300,
        (HALF, HALF),
        True,
        "turing_costa_rica_species_classifier",
        "SPECIES",
    ),
    "anguilla_moths_turing_2024": (
        "ami_resnet50",
        300,
        (HALF, HALF),
        True,
        "turing_anguilla_species_classifier",
        "SPECIES",
    ),
    "kenya-uganda_moths_turing_2024": (
        "ami_resnet50",
        300,
        (HALF, HALF),
        True,
        "turing_kenya_and_uganda_species_classifier",
        "SPECIES",
    ),
    "global_moths_2024": (
        "timm/resnet50",
        128,
        IMAGENET,
        True,
        "global_species_classifier_aug_2024",
        "SPECIES",
    ),
    "moth_binary": ("resnet50", 128, IMAGENET, False, "moth_nonmoth_classifier", "SUPERFAMILY"),
    "insect_orders_2025": (
        "timm/convnext_tiny_in22k",
        128,
        IMAGENET,
        False,
        "insect_order_classifier",
        "ORDER",
    ),
}


def test_the_catalogue_holds_amis_ten_slugs_in_its_order() -> None:
    assert tuple(EXPECTED) == CATALOGUE


@pytest.mark.parametrize("slug", list(EXPECTED))
def test_each_slug_resolves_to_amis_stages(slug: str) -> None:
    architecture, size, (mean, std), filtered, key, rank = EXPECTED[slug]
    pipeline = resolve(slug)
    assert problems(pipeline) == []
    detector, classifier = pipeline.detector, pipeline.classifier
    assert detector is not None and classifier is not None
    assert (detector.architecture, detector.key) == (
        "fasterrcnn_resnet50_fpn",
        "fasterrcnn_for_ami_moth_traps_2023",
    )
    assert (detector.score_threshold, detector.max_detections) == (0.8, 500)
    assert (detector.min_size, detector.max_size, detector.labels) == (800, 1333, ("object",))
    assert detector.whole_pixel_boxes and detector.checkpoint_entry == "model_state_dict"
    assert detector.sizes_apart  # boxes independent of batch-mates
    assert detector.frozen_batch_norms  # as AMI's pretrained-backbone build has them
    assert detector.weights == BASE + "moths/localization/fasterrcnn_resnet50_fpn_tz53qv9v.pt"
    if filtered:
        assert pipeline.filter is not None
        f = pipeline.filter
        assert (f.key, f.architecture, f.keep) == ("moth_nonmoth_classifier", "resnet50", ("moth",))
        assert f.dropped_terminal is False  # ami worker: the filter's label is never terminal
        assert (f.preprocess.size, f.preprocess.mean, f.preprocess.std) == (128, *IMAGENET)
    else:
        assert pipeline.filter is None
    pre = classifier.preprocess
    assert (classifier.architecture, classifier.key) == (architecture, key)
    assert (pre.size, pre.resize, pre.resize_in, pre.mean, pre.std) == (
        size,
        "squash",
        "float",
        mean,
        std,
    )
    assert classifier.checkpoint_entry == "model_state_dict"
    assert classifier.registered is not None and classifier.registered.taxon_rank == rank
    assert classifier.registered.key == key
    assert (pipeline.title, pipeline.version) == (classifier.name, 1)
    assert pipeline.description == classifier.registered.description


@pytest.mark.parametrize("slug", list(EXPECTED))
def test_no_digest_is_read_into_a_files_name(slug: str) -> None:
    """The 8 hex digits some of AMI's names end with are names, not digests: nothing shows
    they are part of a sha256, so no stage declares one (each file is pinned as recorded)."""
    for stage in resolve(slug).stages():
        assert (stage.weights_digest, stage.labels_digest) == (None, None), stage.weights


def test_the_sizes_are_those_amis_model_cards_publish() -> None:
    sizes = catalogue.published_sizes()
    by_name = {path.rpartition("/")[2]: size for path, size in sizes.items()}
    assert by_name == {
        "fasterrcnn_resnet50_fpn_tz53qv9v.pt": 330_066_092,
        "moth-nonmoth_resnet50_20240417_b4fe3efe.pth": 94_373_731,
        "quebec-vermont_resnet50_baseline_20240417_950de764.pth": 114_822_755,
        "uk-denmark_resnet50_baseline_20240417_55250a8b.pth": 115_691_491,
        "panama_resnet50_baseline_20240417_edbb46dd.pth": 99_570_019,
        "global_resnet50_20240828_b06d3b3a.pth": 333_489_027,
        "convnext_tiny_in22k_worder0.5_wbinary0.5_run2_checkpoint.pt": 334_241_031,
    }
    hosts = catalogue.file_hosts("", (), True)
    uri = resolve("moth_binary").stages()[0].weights
    assert isinstance(uri, str) and uri.startswith(BASE)  # named and cached as AMI names it
    assert hosts.candidates(uri) == (
        uri.replace(BASE, catalogue.AMI_CURRENT_BASE),  # AMI's current host first
        uri,
    )
    assert "/swift/v1/AUTH_" in catalogue.AMI_CURRENT_BASE  # the card: the segment is required


def test_declared_sizes_and_urls_of_the_published_files() -> None:
    sizes = {slug: catalogue.model_of(slug).classes for slug in CATALOGUE}
    assert sizes["global_moths_2024"] == 29176
    assert sizes["quebec_vermont_moths_2023"] == 2497
    assert sizes["uk_denmark_moths_2023"] == 2603
    assert sizes["panama_moths_2024"] == 636
    assert sizes["panama_moths_2023"] == 1060
    assert sizes["insect_orders_2025"] == 16 and sizes["moth_binary"] == 2
    orders = resolve("insect_orders_2025").classifier
    assert orders is not None and orders.labels == (
        BASE + "insect_orders/insect_order_category_map.json"
    )
    assert orders.weights == (
        BASE + "insect_orders/convnext_tiny_in22k_worder0.5_wbinary0.5_run2_checkpoint.pt"
    )


@pytest.mark.parametrize(
    "mirror", ["/srv/ami", "/srv/ami/", "file:///srv/ami", "s3://models/ami", "https://m.example/a"]
)
def test_the_files_mirror_replaces_amis_base_and_registration_keeps_amis_urls(
    mirror: str,
) -> None:
    pipeline = resolve("quebec_vermont_moths_2023", "", mirror)
    base = mirror.rstrip("/") + "/"
    for stage in pipeline.stages():
        assert isinstance(stage.weights, str) and stage.weights.startswith(base), stage.weights
        assert stage.registered is not None and stage.registered.uri is not None
        assert stage.registered.uri.startswith(BASE)
        assert stage.weights.removeprefix(base) == stage.registered.uri.removeprefix(BASE)
    assert pipeline.filter is not None and pipeline.filter.labels == (
        base + "moths/classification/05-moth-nonmoth_category_map.json"
    )


def test_an_unknown_pipeline_names_amis_slugs() -> None:
    with pytest.raises(ConfigError) as error:
        resolve("quebec_vermont_moths_2099")
    assert all(slug in str(error.value) for slug in EXPECTED)


def test_amis_resnet50_wrapper_keys_are_its_modules_names() -> None:
    keys = list(build_classifier("ami_resnet50", 7).state_dict())
    assert keys[:2] == ["backbone.0.weight", "backbone.1.weight"]  # conv1, bn1
    assert "backbone.4.0.conv1.weight" in keys and "backbone.7.2.bn3.running_var" in keys
    assert keys[-1] == "classifier.weight" and "classifier.bias" not in keys
    assert not any(k.startswith(("fc.", "layer1.", "avgpool.")) for k in keys)
    assert build_classifier("ami_resnet50", 7).state_dict()["classifier.weight"].shape == (
        7,
        2048,
    )


def test_timm_and_torchvision_layouts_keep_their_own_key_names() -> None:
    torchvision_keys = build_classifier("resnet50", 2).state_dict()
    assert {"conv1.weight", "fc.weight", "fc.bias"} <= set(torchvision_keys)
    timm_resnet = build_classifier("timm/resnet50", 3).state_dict()
    assert {"conv1.weight", "fc.weight", "fc.bias"} <= set(timm_resnet)
    assert timm_resnet["fc.weight"].shape == (3, 2048)
    convnext = build_classifier("timm/convnext_tiny_in22k", 4).state_dict()
    assert {"stem.0.weight", "head.norm.weight", "head.fc.weight", "head.fc.bias"} <= set(convnext)
    assert convnext["head.fc.weight"].shape == (4, 768)


def test_a_timm_architecture_without_timm_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(ConfigError, match=r"inference-worker\[ami\]"):
        layouts.build("timm/resnet50", 3)
    assert build_classifier("ami_resnet50", 3) is not None  # no timm needed


def test_a_category_map_is_read_as_labels_by_index() -> None:
    assert labels_of(json.dumps(species_map()), "m.json") == tuple(labels_by_index(species_map()))
    assert labels_of('{"nonmoth": 1, "moth": 0}', "m.json") == ("moth", "nonmoth")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[1, 2]", "JSON object"),
        ('{"a": 0, "b": 0}', "twice"),
        ('{"a": 0, "b": 2}', "indices"),
        ('{"a": "0"}', "not an int"),
        ("{", "not JSON"),
    ],
)
def test_a_broken_category_map_is_a_clear_error(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        labels_of(text, "m.json")


def _write_stage(root: Path, slug: str, wrapped: bool, seed: int = 3) -> None:
    model = catalogue.model_of(slug)
    assert model.labels is not None
    state = classifier_state(model.architecture, len(SPECIES), seed)
    (root / model.weights).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state_dict": state, "epoch": 3} if wrapped else state, root / model.weights)
    (root / model.labels).write_text(json.dumps(species_map()))


def _reference(slug: str, root: Path, crop: torch.Tensor) -> torch.Tensor:
    """AMI's worker's arithmetic, written with torchvision's transforms: ToTensor, Resize to
    (size, size) with antialiasing, Normalize; the module built afresh from the file."""
    from torchvision import transforms

    model = catalogue.model_of(slug)
    checkpoint = torch.load(root / model.weights, weights_only=True)
    module = build_classifier(model.architecture, len(SPECIES))
    module.load_state_dict(checkpoint.get("model_state_dict") or checkpoint)
    tensor = crop.float() / 255.0  # ToTensor
    tensor = transforms.Resize((model.size, model.size), antialias=True)(tensor)
    tensor = transforms.Normalize(model.mean, model.std)(tensor)
    with torch.no_grad():
        out: torch.Tensor = module.eval()(tensor[None])
    return out[0]


@pytest.mark.parametrize(
    ("slug", "wrapped"),
    [("costa_rica_moths_turing_2024", True), ("global_moths_2024", False)],
)
def test_crops_are_squashed_and_normalised_as_amis_worker_does(
    tmp_path: Path, slug: str, wrapped: bool
) -> None:
    _write_stage(tmp_path, slug, wrapped)
    stage = resolve(slug, "", str(tmp_path)).classifier
    assert stage is not None
    model = ClassifierModel(stage, SourceConfig(), torch.device("cpu"))
    assert model.algorithm.labels == tuple(labels_by_index(species_map()))
    torch.manual_seed(5)
    crop = torch.randint(0, 256, (3, 57, 91), dtype=torch.uint8)

    squared = _squared(crop, stage.preprocess)
    logits = model.logits(squared[None])[0]

    side = stage.preprocess.size
    assert squared.dtype == torch.float32 and squared.shape == (3, side, side)
    expected = _reference(slug, tmp_path, crop)
    assert torch.allclose(logits, expected, rtol=1e-3, atol=1e-3), (logits, expected)


def test_a_float_crop_already_at_the_input_size_is_not_resampled() -> None:
    stage = resolve("moth_binary").classifier
    assert stage is not None
    crop = torch.randint(0, 256, (3, 128, 128), dtype=torch.uint8)
    assert torch.equal(_squared(crop, stage.preprocess), crop.float())


def test_registration_is_amis_pipeline_config() -> None:
    pipeline = resolve("quebec_vermont_moths_2023")
    labels = {"d": ("object",), "f": ("moth", "nonmoth"), "c": SPECIES}
    algorithms = tuple(
        Algorithm(s.key, s.name, task, "ab" * 32, labels[tag], s.registered)
        for s, task, tag in zip(
            pipeline.stages(), ("detection", "classification", "classification"), "dfc", strict=True
        )
    )
    served = AntennaPipeline(
        pipeline.name, pipeline.description, algorithms, pipeline.title, pipeline.version
    )
    config = served.config()
    assert {k: config[k] for k in ("name", "slug", "version", "description")} == {
        "name": "Quebec & Vermont Species Classifier - Apr 2024",
        "slug": "quebec_vermont_moths_2023",
        "version": 1,
        "description": "Trained on April 17, 2024 for 2,497 species. "
        "https://wandb.ai/moth-ai/ami-gbif-fine-grained/runs/1x53zmp2/overview",
    }
    detector, binary, species = config["algorithms"]
    assert detector == {
        "name": "FasterRCNN for AMI Moth Traps 2023",
        "key": "fasterrcnn_for_ami_moth_traps_2023",
        "description": "Model trained on GBIF images and synthetic data in 2023. "
        "Accurate but can be slow on a machine without GPU.",
        "task_type": "localization",
        "version": 1,
        "version_name": None,
        "uri": BASE + "moths/localization/fasterrcnn_resnet50_fpn_tz53qv9v.pt",
        "category_map": {
            "data": [],
            "labels": [],
            "version": None,
            "description": None,
            "uri": None,
        },
    }
    assert (binary["name"], binary["key"], binary["task_type"]) == (
        "Moth / Non-Moth Classifier",
        "moth_nonmoth_classifier",
        "classification",
    )
    assert binary["description"] == "Trained on April 17, 2024"
    assert binary["category_map"]["data"] == [
        {"index": 0, "label": "moth", "taxon_rank": "SUPERFAMILY"},
        {"index": 1, "label": "nonmoth", "taxon_rank": "SUPERFAMILY"},
    ]
    assert binary["category_map"]["uri"] == (
        BASE + "moths/classification/05-moth-nonmoth_category_map.json"
    )
    assert species["key"] == "quebec_vermont_species_classifier_apr_2024"
    assert species["uri"] == (
        BASE + "moths/classification/quebec-vermont_resnet50_baseline_20240417_950de764.pth"
    )
    assert species["category_map"]["labels"] == list(SPECIES)
    assert {d["taxon_rank"] for d in species["category_map"]["data"]} == {"SPECIES"}
    assert [antenna_key(a) for a in algorithms] == [a["key"] for a in config["algorithms"]]


def test_the_same_stage_in_two_pipelines_is_loaded_once(tmp_path: Path) -> None:
    binary = catalogue.BINARY
    assert binary.labels is not None
    (tmp_path / binary.weights).parent.mkdir(parents=True)
    torch.save(classifier_state("resnet50", 2, 1, 0), tmp_path / binary.weights)
    (tmp_path / binary.labels).write_text(json.dumps(BINARY_MAP))
    as_filter = resolve("panama_moths_2023", "", str(tmp_path)).filter
    alone = resolve("moth_binary", "", str(tmp_path)).classifier
    assert as_filter is not None and alone is not None and as_filter != alone  # keep differs
    cpu = torch.device("cpu")

    first = shared.classifier(as_filter, SourceConfig(), cpu, "float32")
    second = shared.classifier(alone, SourceConfig(), cpu, "float32")

    assert first is second
    assert shared.classifier(alone, SourceConfig(), cpu, "bfloat16") is not first


class _NoDetector(torch.nn.Module):
    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        raise AssertionError("not run: cleaned() is given the rows")


def test_frozen_batch_norms_compute_scale_and_shift_as_a_pretrained_backbone_does() -> None:
    from pipelines.models import freeze_batch_norms

    torch.manual_seed(0)
    norm = torch.nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.uniform_(-1.0, 1.0)
        norm.running_mean.uniform_(-1.0, 1.0)
        norm.running_var.uniform_(0.1, 3.0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), norm)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        features = model[0](x)
        # torchvision's FrozenBatchNorm2d arithmetic, written out
        scale = norm.weight * (norm.running_var + norm.eps).rsqrt()
        shift = norm.bias - norm.running_mean * scale
        expected = features * scale[None, :, None, None] + shift[None, :, None, None]

        frozen = freeze_batch_norms(model)

        assert type(frozen[1]).__name__ == "FrozenBatchNorm2d"
        assert torch.equal(frozen(x), expected)


class _Padding(torch.nn.Module):
    """Like torchvision's detectors, sees its batch padded to the largest image: one box per
    image, at the padded batch's middle."""

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        height = max(int(i.shape[-2]) for i in images)
        width = max(int(i.shape[-1]) for i in images)
        box = torch.tensor([[width / 4, height / 4, width / 2, height / 2]])
        found = {"boxes": box, "scores": torch.tensor([0.9]), "labels": torch.tensor([1])}
        return [dict(found) for _ in images]


@pytest.mark.parametrize("apart", [True, False])
def test_sizes_apart_gives_each_image_the_boxes_it_gets_alone(apart: bool) -> None:
    from pipelines.declare import Detector
    from pipelines.models import DetectorModel

    stage = Detector("d", architecture=lambda _n: _Padding(), sizes_apart=apart)
    model = DetectorModel(stage, SourceConfig(), torch.device("cpu"))
    small, large = (torch.zeros((3, h, w), dtype=torch.uint8) for h, w in ((40, 50), (60, 90)))
    alone = model.detect([small])[0].boxes.tolist()

    together = model.detect([small, large, small])

    assert alone == [[12.5, 10.0, 25.0, 20.0]]
    assert together[1].boxes.tolist() == [[22.5, 15.0, 45.0, 30.0]]
    if apart:
        assert together[0].boxes.tolist() == together[2].boxes.tolist() == alone
    else:  # the small images' boxes moved by the padding
        assert together[0].boxes.tolist() == [[22.5, 15.0, 45.0, 30.0]] != alone


@pytest.mark.parametrize(("whole", "expected"), [(True, [10.0, 5.0, 30.0, 20.0]), (False, None)])
def test_whole_pixel_boxes_are_truncated_as_amis_detector_does(
    whole: bool, expected: list[float] | None
) -> None:
    from pipelines.declare import Detector
    from pipelines.models import DetectorModel

    stage = Detector(
        "d", architecture=lambda _n: _NoDetector(), labels=("object",), whole_pixel_boxes=whole
    )
    model = DetectorModel(stage, SourceConfig(), torch.device("cpu"))
    rows = torch.tensor([[10.9, 5.2, 30.99, 20.5, 0.95, 1.0], [1.0, 1.0, 1.7, 9.0, 0.9, 1.0]])
    image = torch.zeros((3, 40, 50), dtype=torch.uint8)

    (boxes,) = model.cleaned([image], rows, [2])

    if whole:  # the second box truncates to no width: dropped
        assert boxes.boxes.tolist() == [expected]
    else:
        assert torch.equal(boxes.boxes, rows[:, :4])


def test_the_command_lines_help_lists_amis_slugs() -> None:
    from worker.commands.cli import _parser

    text = " ".join(_parser().format_help().split())
    assert all(slug in text.replace("- ", "-") for slug in EXPECTED), text
    assert "WORKER_MODEL__FILES_MIRROR" in text


def test_a_float_crop_resize_only_squashes() -> None:
    from dataclasses import replace

    pipeline = resolve("moth_binary")
    assert pipeline.classifier is not None
    pre = replace(pipeline.classifier.preprocess, resize="shorter_crop")
    broken = replace(pipeline, classifier=replace(pipeline.classifier, preprocess=pre))
    assert problems(broken) == [
        "stage 'moth_nonmoth_classifier': preprocess.resize_in is uint8, or float to squash"
    ]


def test_a_mirrored_file_that_is_not_amis_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    """By default a mirror must hold AMI's own files: the size AMI publishes is checked, so
    other weights under that name are refused before they are loaded."""
    from pipelines.files.fetch import ModelFiles

    _write_stage(tmp_path, "global_moths_2024", False)
    stage = resolve("global_moths_2024", "", str(tmp_path)).classifier
    assert stage is not None and stage.weights_digest is None
    files = ModelFiles(SourceConfig(), hosts=catalogue.file_hosts(str(tmp_path), (), True))
    with pytest.raises(ConfigError, match=r"global_resnet50_20240828_b06d3b3a\.pth refused.*"
                       r"expected 333489027 bytes, got [0-9]+ bytes"):  # fmt: skip
        ClassifierModel(stage, SourceConfig(), torch.device("cpu"), files=files)
