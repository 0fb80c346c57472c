"""Drafters and the frozen target they serve: `load_target`, `load_drafter`."""

from specdraft.drafters.checkpoint import load_drafter
from specdraft.drafters.target import Target, load_target

__all__ = ["Target", "load_drafter", "load_target"]
