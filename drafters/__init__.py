"""Drafters and the frozen target they serve: `load_target`, `load_drafter`, and
`load_decoding` (the settings a drafter folder is served with)."""

from specdraft.drafters.checkpoint import load_decoding, load_drafter
from specdraft.drafters.target import Target, load_target

__all__ = ["Target", "load_decoding", "load_drafter", "load_target"]
