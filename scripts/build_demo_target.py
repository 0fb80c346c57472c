"""`python scripts/build_demo_target.py ...` from a checkout: the same program as `specdraft build-demo-target`
(src/specdraft/tools/build_demo_target.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
