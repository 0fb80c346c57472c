"""`python scripts/parity.py ...` from a checkout: the same program as `specdraft parity`
(src/specdraft/tools/parity.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
