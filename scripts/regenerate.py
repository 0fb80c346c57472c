"""`python scripts/regenerate.py ...` from a checkout: the same program as `specdraft regenerate`
(src/specdraft/tools/regenerate.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
