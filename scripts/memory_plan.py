"""`python scripts/memory_plan.py ...` from a checkout: the same program as `specdraft memory-plan`
(src/specdraft/tools/memory_plan.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
