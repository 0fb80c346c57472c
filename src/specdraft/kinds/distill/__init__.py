"""the two-model draft: the kind `distill` (its drafter is distill.py)."""
