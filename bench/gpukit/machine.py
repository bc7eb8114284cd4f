"""The GPU machine the device tool lends (kind ``nvidia-h200``), as its notes describe it: its
Python, its platform, what it has installed, and what travels to it. Standard library only."""

from __future__ import annotations

import re

# The device tool carries at most this much of the working tree: tracked files, untracked
# files git does not ignore, and the ignored folders named in ``carry`` (the kit).
CARRY_LIMIT_BYTES = 64 * 2**20
# python3 there is Python 3.12.3 (/opt/torch/.venv/bin/python3), torch 2.11.0+cu130 and
# torchvision 0.26.0 (KINDS.md's pip list row, seen 2026-11).
PYTHON_VERSION = "3.12"
PINS = {"torch": "2.11.0", "torchvision": "0.26.0"}
# x86-64; manylinux tags up to glibc 2.35 (pip matches each tag exactly, so all are named; the
# device notes name 17 to 35 as those wheels use). Pure-Python wheels match any.
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in range(5, 36)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)

# KINDS.md, "Python packages already there", for nvidia-h200's image 'cuda' as last read on a
# machine running it; read into this list on 2026-12-04. Carried only for another version.
PACKAGES_READ_ON = "2026-11-17"
_AS_LISTED = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
    ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
    psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp
"""
PACKAGES = frozenset(_AS_LISTED.split())
# Never carried, whatever resolves: the machine's own torch build and the CUDA libraries it
# was built with (a wheel of another build would replace them for every process there).
NEVER = frozenset({"torch", "torchvision", "torchaudio", "triton"})
NEVER_PREFIXES = ("nvidia-", "cuda-")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them: ``Flask_Cors``, ``flask.cors`` and
    ``flask-cors`` are one name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def never_carried(name: str) -> bool:
    name = canonical(name)
    return name in NEVER or name.startswith(NEVER_PREFIXES)


# Pure-Python packages the machine has, carried all the same: what we carry needs newer ones
# than an image may hold (pydantic 2.14 and pydantic-core import typing_extensions.Sentinel
# and ask for 4.16; flask 3.1, for moto's server, asks werkzeug>=3.1), and newer releases of
# these keep the old API, so the kit's copy, first on PYTHONPATH, serves the machine's too.
CARRY_ANYWAY = frozenset({"typing-extensions", "werkzeug"})


def has(name: str) -> bool:
    """Whether the machine already has ``name`` (any version) and the kit need not carry it."""
    name = canonical(name)
    return name in PACKAGES and name not in CARRY_ANYWAY
