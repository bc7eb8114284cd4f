"""The README documents every setting, so operators never have to read the code."""

from __future__ import annotations

from pathlib import Path

from config.settings import Settings


def test_every_setting_is_in_the_readme():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    for group, field in Settings.model_fields.items():
        nested = getattr(field.default_factory, "model_fields", None)
        if nested is None:
            assert f"`WORKER_{group.upper()}`" in readme
            continue
        for name in nested:
            assert f"`WORKER_{group.upper()}__{name.upper()}`" in readme
