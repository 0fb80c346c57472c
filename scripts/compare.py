"""`python scripts/compare.py ...` from a checkout: the same program as `specdraft compare`
(src/specdraft/tools/compare.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
