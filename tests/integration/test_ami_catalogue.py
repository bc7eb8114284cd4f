"""AMI's pipelines served by slug through the fake Antenna, their files from a local mirror
(``WORKER_MODEL__FILES_MIRROR``): one slug per architecture family (AMI's ResNet-50 wrapper at
300 with 0.5 normalisation, timm's ResNet-50 at 128, timm's ConvNeXt order classifier, the
moth / non-moth ResNet-50 alone), registered as AMI's worker registers them, and one job each
saved with AMI's algorithm names and keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipelines.ami import catalogue
from tests.ami_files import BINARY_MAP, SPECIES, detector_state, labels_by_index, species_map
from tests.antenna_fake import FakeAntenna
from tests.helpers import cli, start_run
from tests.integration.test_antenna import TOKEN, env_for
from worker.commands.demo_images import rectangles_bytes
from worker.commands.localservers import stop_process

pytestmark = pytest.mark.integration
SLUGS = (
    "costa_rica_moths_turing_2024",
    "quebec_vermont_moths_2023",
    "insect_orders_2025",
    "moth_binary",
)
DETECTOR_KEY = "fasterrcnn_for_ami_moth_traps_2023"
BINARY_KEY = "moth_nonmoth_classifier"
BASE = "https://object-arbutus.cloud.computecanada.ca/ami-models/"


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.ami_files import write_mirror

    return write_mirror(tmp_path_factory.mktemp("ami-mirror"), SLUGS, detector_state())


@pytest.fixture
def antenna() -> Iterator[FakeAntenna]:
    fake = FakeAntenna(token=TOKEN)
    with fake.running():
        yield fake


def _env(fake: FakeAntenna, mirror: Path) -> dict[str, str]:
    return env_for(
        fake,
        WORKER_MODEL__PIPELINES=",".join(SLUGS),
        WORKER_MODEL__FILES_MIRROR=str(mirror),
        WORKER_MODEL__PUBLISHED_DIGESTS="false",
        WORKER_LOADER__BATCH_SIZE="1",
    )


def _registered_checks(fake: FakeAntenna) -> None:
    configs = {slug: fake.projects[1][slug]["config"] for slug in SLUGS}
    for slug, config in configs.items():
        model = catalogue.model_of(slug)
        assert (config["name"], config["version"]) == (model.name, 1)
        assert config["description"] == model.description
        keys = [a["key"] for a in config["algorithms"]]
        filtered = slug not in ("moth_binary", "insect_orders_2025")
        assert keys == [DETECTOR_KEY, *([BINARY_KEY] if filtered else []), model.key]
        last = config["algorithms"][-1]
        assert last["uri"] == BASE + model.weights and last["name"] == model.name
        assert last["category_map"]["uri"] == BASE + str(model.labels)
        assert {d["taxon_rank"] for d in last["category_map"]["data"]} == {model.taxon_rank}
        size = len(BINARY_MAP) if slug == "moth_binary" else len(SPECIES)
        assert len(last["category_map"]["labels"]) == size
        assert config["algorithms"][0]["category_map"]["labels"] == []


def _saved_checks(saved: dict[str, list[dict[str, Any]]], slug: str) -> None:
    (detections,) = saved.values()
    assert detections, "the detector found boxes, so crops were classified"
    model = catalogue.model_of(slug)
    filtered = slug not in ("moth_binary", "insect_orders_2025")
    for found in detections:
        assert found["algorithm"] == {"name": catalogue.DETECTOR.name, "key": DETECTOR_KEY}
        box = [found["bbox"][k] for k in ("x1", "y1", "x2", "y2")]
        assert all(float(v).is_integer() for v in box), box  # truncated to whole pixels
        refs = [(c["algorithm"]["name"], c["algorithm"]["key"]) for c in found["classifications"]]
        expected = [(model.name, model.key)]
        if filtered:
            expected.insert(0, (catalogue.BINARY.name, BINARY_KEY))
        assert refs == expected
        last = found["classifications"][-1]
        labels = labels_by_index(BINARY_MAP if slug == "moth_binary" else species_map())
        assert last["terminal"] is True and len(last["scores"]) == len(labels)
        assert (
            last["classification"]
            == labels[max(range(len(labels)), key=last["scores"].__getitem__)]
        )
        if filtered:
            assert found["classifications"][0]["classification"] == "moth"
            assert found["classifications"][0]["terminal"] is False


def test_amis_pipelines_register_as_amis_worker_does_and_their_jobs_are_saved(
    antenna: FakeAntenna, mirror: Path, tmp_path: Path
) -> None:
    env = _env(antenna, mirror)
    done = cli("register", env=env, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    _registered_checks(antenna)

    jobs = {}
    for i, slug in enumerate(SLUGS):
        name = f"{slug}.png"
        antenna.images[name] = rectangles_bytes(120, 90, [(20, 16, 60, 56, "red")], fmt="PNG")
        jobs[slug] = antenna.add_job(slug, [(f"img{i}", antenna.media_url(name))])
    log = tmp_path / "worker.log"
    proc = start_run(env, log, "--until-idle")
    try:
        assert proc.wait(timeout=480) == 0, log.read_text()[-4000:]
    finally:
        stop_process(proc)

    for slug, job in jobs.items():
        assert antenna.jobs[job].status == "SUCCESS", (slug, log.read_text()[-4000:])
        _saved_checks(antenna.jobs[job].saved, slug)
