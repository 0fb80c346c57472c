"""Drafter folders: our checkpoint format (`load_drafter`, `load_decoding`, `save_drafter`) and
the layouts other tools read (exports, and importing them back).

`load_drafter` and `load_decoding` are read from formats/reading.py on first use: reading.py
imports every kind's export (through export_registry.py), and each of those imports
formats/checkpoint.py, so importing this package must not import reading.py itself.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_decoding", "load_drafter"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from specdraft.formats import reading

        return getattr(reading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
