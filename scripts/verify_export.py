"""`python scripts/verify_export.py ...` from a checkout: the same program as `specdraft verify-export`
(src/specdraft/tools/verify_export.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
