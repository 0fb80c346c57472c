"""LayerSkip: the kind `layerskip` (its drafter is layerskip.py)."""
