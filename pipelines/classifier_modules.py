"""torchvision's classifier builders (``resnet18`` ...) without importing the torchvision package.

``import torchvision`` runs its ``__init__``, which imports ``torchvision.ops``, whose
``roi_align`` imports ``torch._dynamo`` (and with it sympy and triton): about 2.5 s of CPU, in
every worker, ``check`` and ``register`` process, for code a classifier never runs. The
classifier modules themselves (``torchvision/models/resnet.py``, ``mobilenetv3.py``,
``convnext.py``) need only ``torchvision.models._api``, ``_utils``, ``_meta``,
``torchvision.ops.misc``, ``ops.stochastic_depth``, ``transforms._presets`` and
``torchvision.utils``: 0.05 s.

So, while torchvision is not imported yet, the three packages ``torchvision``,
``torchvision.models`` and ``torchvision.ops`` are stood in for by bare package modules whose
``__path__`` is the installed one (their ``__init__`` never runs), the one classifier module is
imported through them, its builder is kept, and every ``torchvision`` entry this added to
``sys.modules`` is taken out again: a later ``import torchvision`` (a detector, a plugin, the
GPU decode path) imports the whole package afresh, as if this had never run. Where torchvision
is imported already, or the layout is not the one expected (another torchvision), the builder
comes from ``torchvision.models`` as usual. ``tests/unit/test_classifier_modules.py`` checks
both give the same model. Tested with torchvision 0.29.1.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODULE_OF = {
    "resnet18": "resnet",
    "resnet50": "resnet",
    "mobilenet_v3_small": "mobilenetv3",
    "mobilenet_v3_large": "mobilenetv3",
    "convnext_tiny": "convnext",
}
_STOOD_IN = ("torchvision", "torchvision.models", "torchvision.ops")
# Held while sys.modules has the stand-ins, and by build_detector while it imports torchvision:
# a thread importing torchvision then would be handed a stand-in.
IMPORT_LOCK = threading.Lock()


@functools.cache
def classifier_builder(architecture: str) -> Callable[..., Any]:
    """The builder torchvision names ``architecture`` (a key of ``MODULE_OF``)."""
    with IMPORT_LOCK:
        if "torchvision" not in sys.modules:
            built = _without_the_package(MODULE_OF[architecture], architecture)
            if built is not None:
                return built
        from torchvision import models

        builder: Callable[..., Any] = getattr(models, architecture)
        return builder


def _without_the_package(module: str, architecture: str) -> Callable[..., Any] | None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    if not (root / "models" / f"{module}.py").is_file() or not (root / "ops").is_dir():
        return None
    before = set(sys.modules)
    try:
        for name in _STOOD_IN:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            package.__package__ = name
            sys.modules[name] = package
        builder = getattr(importlib.import_module(f"torchvision.models.{module}"), architecture)
    except (ImportError, AttributeError):
        return None  # another layout: the package's own import below
    finally:
        for name in set(sys.modules) - before:
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]
    return builder if callable(builder) else None
