"""`python scripts/evaluate.py ...` from a checkout: the same program as `specdraft evaluate`
(src/specdraft/tools/evaluate.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
