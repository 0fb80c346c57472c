"""The tiny demo target as a GGUF file, shared by the tests of real targets."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_kit import write_llama_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tiny_target_path, tmp_path_factory) -> Path:
    """The tiny demo target as an F32 GGUF file (dequantizes to the same weights exactly)."""
    out = tmp_path_factory.mktemp("gguf") / "tiny-demo.F32.gguf"
    return write_llama_gguf(Path(tiny_target_path), out)
