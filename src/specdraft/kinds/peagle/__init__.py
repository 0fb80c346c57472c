"""P-EAGLE: the kind `peagle` (its drafter is peagle.py)."""
