"""Drafter kinds: the Drafter and DraftSession contracts and the kind registry (base.py), one
file per kind (with its session module where it has one), prompt lookup and lean drafting."""
