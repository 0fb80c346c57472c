"""`python scripts/tune.py ...` from a checkout: the same program as `specdraft tune`
(src/specdraft/tools/tune.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
