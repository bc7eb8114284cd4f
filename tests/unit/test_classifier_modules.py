"""The built-in classifiers come without importing the torchvision package, and are the same
models torchvision's package builds (pipelines/classifier_modules.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipelines.architectures import TORCHVISION as CLASSIFIERS
from pipelines.classifier_modules import MODULE_OF

ROOT = Path(__file__).parents[2]


def _python(script: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter at the repository root (nothing imported before it)."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


# In a fresh interpreter: each classifier built the light way, then torchvision imported whole,
# the same architecture built by it, the light model's weights loaded into it (strict) and both
# run on one input.
_SCRIPT = """
import sys
import torch
from pipelines.architectures import build_classifier
torch.manual_seed(0)
light = {a: build_classifier(a, 7).eval() for a in sys.argv[1:]}
print("dynamo", "torch._dynamo" in sys.modules)
print("left", sorted(m for m in sys.modules if m.split(".")[0] == "torchvision"))
import importlib.util
print("found", importlib.util.find_spec("torchvision").name)
import torchvision
import torchvision.ops.roi_align  # the package whole, as a detector imports it
from torchvision import models
x = torch.rand(2, 3, 64, 64)
for a, model in light.items():
    reference = getattr(models, a)(weights=None, num_classes=7).eval()
    reference.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        print("same", a, torch.equal(model(x), reference(x)), type(model).__name__)
print("after", build_classifier("resnet18", 3).fc.out_features, models.resnet.ResNet.__name__)
print("isinstance", isinstance(light["resnet18"], models.ResNet))
"""


def test_each_classifier_is_built_without_torchvision_and_equals_torchvisions_own() -> None:
    assert set(MODULE_OF) == set(CLASSIFIERS)
    done = _python(_SCRIPT, *CLASSIFIERS, timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "dynamo False" in lines, done.stdout
    assert "left []" in lines, done.stdout  # nothing named torchvision is made or left
    assert "found torchvision" in lines, done.stdout
    for architecture in CLASSIFIERS:
        (line,) = [s for s in lines if s.startswith(f"same {architecture} ")]
        assert line.split()[2] == "True", line
    assert "after 3 ResNet" in lines, done.stdout
    assert "isinstance False" in lines, done.stdout  # the private root's classes (docstring)


def test_with_torchvision_imported_the_builder_is_torchvisions_own() -> None:
    done = _python(
        "import torchvision.models as m\n"
        "from pipelines.classifier_modules import classifier_builder\n"
        "print(classifier_builder('mobilenet_v3_small') is m.mobilenet_v3_small)"
    )
    assert done.stdout.strip() == "True", done.stderr[-3000:]


def test_a_light_import_that_fails_falls_back_to_torchvision_and_leaves_nothing() -> None:
    script = (
        "import sys\n"
        "import pipelines.classifier_modules as cm\n"
        "cm.MODULE_OF = {**cm.MODULE_OF, 'resnet18': 'no_such_module'}\n"
        "builder = cm.classifier_builder('resnet18')\n"
        "import torchvision.models as m\n"
        "print(builder is m.resnet18, [n for n in sys.modules if n.startswith(cm.ROOT)])\n"
    )
    done = _python(script)
    assert done.stdout.strip().splitlines()[-1] == "True []", done.stdout + done.stderr[-3000:]
    assert "classifier_light_import_failed" in done.stdout + done.stderr
