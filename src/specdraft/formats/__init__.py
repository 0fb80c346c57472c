"""Drafter folders: our checkpoint format (`load_drafter`, `load_decoding`, `save_drafter`) and
the layouts other tools read (exports, and importing them back)."""

from specdraft.formats.reading import load_decoding, load_drafter

__all__ = ["load_decoding", "load_drafter"]
