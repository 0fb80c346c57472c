"""DSpark: the kind `dspark` (its drafter is dspark.py)."""
