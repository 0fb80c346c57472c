"""The install maps the repository's folders into the specdraft namespace (DESIGN.md, "Layout")."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", ["data", "drafters", "inference", "train", "scripts"])
def test_subpackages_resolve_to_this_repository(package):
    module = importlib.import_module(f"specdraft.{package}")
    assert Path(module.__file__).resolve() == ROOT / package / "__init__.py"


def test_imports_work_from_any_directory(tmp_path):
    code = "import specdraft.data, specdraft.drafters.target; print(specdraft.data.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert Path(out.stdout.strip()).resolve() == ROOT / "data" / "__init__.py"


def test_demo_prompts_is_exported():
    from specdraft.data import demo_prompts

    assert len(demo_prompts(3)) == 3
