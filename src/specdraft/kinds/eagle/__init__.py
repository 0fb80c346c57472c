"""EAGLE-1/2 and EAGLE-3: the kind `eagle` (its drafter is eagle.py)."""
