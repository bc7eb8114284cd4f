"""torchvision's classifier builders (``resnet18`` ...) without importing the torchvision package.

``import torchvision`` runs its ``__init__``, which imports ``torchvision.ops``, whose
``roi_align`` imports ``torch._dynamo`` (and with it sympy and triton): about 2.5 s of CPU, in
every worker, ``check`` and ``register`` process, for code a classifier never runs. The
classifier modules themselves (``torchvision/models/resnet.py``, ``mobilenetv3.py``,
``convnext.py``) import only, and only relatively, ``models._api``, ``_utils``, ``_meta``,
``ops.misc``, ``ops.stochastic_depth``, ``transforms`` and ``utils``: 0.05 s.

So, while torchvision is not imported yet, the classifier module is imported under a private
root, ``_inference_worker_torchvision``: a package whose ``__path__`` is the installed
torchvision's, as are those of its ``models`` and ``ops``, none of whose ``__init__`` runs.
Nothing named ``torchvision`` is touched, so a later ``import torchvision`` (a detector, a
plugin, the GPU decode path) is the package's own, in any thread or forked child. The light
models' classes live in that private root: ``isinstance`` against torchvision's classes is
False and ``torch.save`` of a whole module would name the private root (the worker saves and
loads ``state_dict`` only). Where torchvision is imported already, or the light import fails
(another layout), the builder is torchvision's own. ``tests/unit/test_classifier_modules.py``
checks both give the same model. Tested with torchvision 0.29.1.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

log = structlog.get_logger(__name__)

MODULE_OF = {
    "resnet18": "resnet",
    "resnet50": "resnet",
    "mobilenet_v3_small": "mobilenetv3",
    "mobilenet_v3_large": "mobilenetv3",
    "convnext_tiny": "convnext",
}
ROOT = "_inference_worker_torchvision"
_BARE = ("", "models", "ops")  # packages whose __init__ is not run
_LOCK = threading.Lock()  # one light import at a time


def classifier_builder(architecture: str) -> Callable[..., Any]:
    """The builder torchvision names ``architecture`` (a key of ``MODULE_OF``)."""
    if "torchvision" not in sys.modules:
        module = _light_module(MODULE_OF[architecture])
        if module is not None:
            light: Callable[..., Any] = getattr(module, architecture)
            return light
    from torchvision import models

    builder: Callable[..., Any] = getattr(models, architecture)
    return builder


@functools.cache
def _light_module(name: str) -> ModuleType | None:
    with _LOCK:
        spec = importlib.util.find_spec("torchvision")
        if spec is None or spec.origin is None:
            return None
        installed = Path(spec.origin).parent
        try:
            for part in _BARE:
                _bare_package(installed, part)
            return importlib.import_module(f"{ROOT}.models.{name}")
        except Exception as error:  # noqa: BLE001 - another layout: torchvision's own import
            log.warning("classifier_light_import_failed", module=name, error=repr(error))
            for entry in [m for m in sys.modules if m == ROOT or m.startswith(f"{ROOT}.")]:
                sys.modules.pop(entry, None)
            return None


def _bare_package(installed: Path, part: str) -> None:
    """``ROOT.part`` as a package of ``installed/part`` whose ``__init__`` is not run."""
    name = f"{ROOT}.{part}" if part else ROOT
    if name in sys.modules:
        return
    directory = installed / part if part else installed
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    if spec is None:
        raise ImportError(f"no package at {directory}")
    sys.modules[name] = importlib.util.module_from_spec(spec)
