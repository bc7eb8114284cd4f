# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs
# into .venv, at the exact versions of constraints.txt (torch 2.14.1, torchvision 0.29.1);
# pyproject.toml holds only the ranges the code supports.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo check test promtool chaos bench clean gpu-kit image
# Our own code, compiled to bytecode before the tests: the suite starts more than 300 Python
# processes (workers, their fork servers, CLI commands, benchmarks), and where
# PYTHONDONTWRITEBYTECODE is set (it is on the development machine) each would compile every
# module it imports again, about 0.4 s of CPU per worker.
OWN_CODE := config datasets pipelines worker testing bench tests

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/inference-worker demo

# make check: the inner loop before a commit (CONTRIBUTING.md): lint, types and the unit tests
# (tests/unit: no nats-server, S3 or supervisord started).
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2 tests/unit

# promtool (Debian's prometheus package) unit-tests the alert rules.
promtool:
	@command -v promtool >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }

# make test: lint, types, then every test under tests/ (unit, integration, supervisord,
# Prometheus, Antenna, the bench smokes and the 12 chaos scenarios) in three processes, each
# with its own nats-server, S3 endpoint and temp dirs, handed one test at a time
# (--maxschedchunk 1); the tests of tests/slowest.tsv start first, longest first, and the 25
# slowest (wall) and the 25 dearest (CPU, tests/cputime.py) are listed at the end.
# Here (2 cores): 12 min 15 s alone on the machine on 2026-12-02 (736 s, 1108 s of CPU); on
# 2026-12-03, a slower day for this machine, 19 min 26 s (1166 s, 1913 s of CPU), then 16 min 58 s
# (1018 s, 1644 s of CPU) with the classifiers built without the torchvision package and the
# bytecode compiled first. The tests' CPU keeps two cores busy for longer than 10 minutes.
test: $(STAMP) promtool
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m compileall -q -j 0 $(OWN_CODE)
	$(BIN)/python -m pytest -q -n 3 --maxschedchunk 1 --durations=25

# By hand, not in CI: make chaos prints the chaos table (the same 12 scenarios make test runs,
# one row each, 3 to 5 minutes on 2 cores); make bench, the CPU benchmarks behind BENCHMARKS.md
# (its table at the top: what each guards; bench.gpu and the GPU kit need a GPU).
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(BIN)/python -m bench.throughput --runs 5
	$(BIN)/python -m bench.preprocess --images 30
	$(BIN)/python -m bench.workload
	$(BIN)/python -m bench.network --images 24 --tasks 96 --runs 3
	$(BIN)/python -m bench.soak
	$(BIN)/python -m bench.pipelines
	$(BIN)/python -m bench.many_jobs --jobs 10000
	$(BIN)/python -m bench.antenna_wan --tasks 2000 --nats

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

# make gpu-kit, on a machine with network: the wheels the lent GPU machine lacks, for its
# Python (PYTHON_VERSION, 3.12 there), into .gpukit/ (ignored by git; the device tool's call
# carries it: BENCHMARKS.md, "The GPU path"). PYTHON_VERSION=3.11 GPU_KIT=/tmp/kit311 for a
# dry run here. CI's exact versions (constraints.txt) where the machine has no version of its own.
PYTHON_VERSION ?= 3.12
GPU_KIT ?= .gpukit
gpu-kit:
	$(PYTHON) -m bench.gpukit gather --python-version $(PYTHON_VERSION) --out $(GPU_KIT) \
	  $(if $(wildcard constraints.txt),--constraint constraints.txt)

# make image, by hand (not in make test: BENCHMARKS.md, "The container image"): the Dockerfile
# built with buildah from a base of Debian's packages (mmdebstrap) and the wheels this machine
# already has (pip's local indexes, gathered once into $(IMAGE_DIR)/wheels and mounted into the
# build, never downloaded again), niced: the machine is shared.
IMAGE ?= localhost/inference-worker:latest
IMAGE_BASE ?= localhost/inference-worker-base:bookworm
IMAGE_DIR ?= .image
BUILDAH_ISOLATION ?= chroot
image: $(STAMP)
	@command -v buildah >/dev/null && command -v podman >/dev/null && command -v mmdebstrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq buildah podman mmdebstrap; }
	mkdir -p $(IMAGE_DIR)/wheels
	podman image exists $(IMAGE_BASE) || { \
	  nice -n 10 mmdebstrap --variant=apt --include=python3,python3-venv,ca-certificates,supervisor \
	    bookworm $(IMAGE_DIR)/base.tar && podman import $(IMAGE_DIR)/base.tar $(IMAGE_BASE) && \
	  rm $(IMAGE_DIR)/base.tar; }
	nice -n 10 $(BIN)/python -m pip download -q -c constraints.txt --prefer-binary \
	  -d $(IMAGE_DIR)/wheels '.[ami]' setuptools wheel
	nice -n 10 buildah bud --isolation $(BUILDAH_ISOLATION) --format docker --layers=false \
	  --build-arg BASE=$(IMAGE_BASE) --build-arg WHEELS=/wheels \
	  -v $(abspath $(IMAGE_DIR))/wheels:/wheels:ro -t $(IMAGE) .
	podman image ls $(IMAGE)
