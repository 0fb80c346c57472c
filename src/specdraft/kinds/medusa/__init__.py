"""Medusa-1 and Medusa-2: the kind `medusa` (its drafter is medusa.py)."""
