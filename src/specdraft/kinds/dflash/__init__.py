"""DFlash: the kind `dflash` (its drafter is dflash.py)."""
