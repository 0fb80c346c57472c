"""`python scripts/export.py ...` from a checkout: the same program as `specdraft export`
(src/specdraft/tools/export.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
