"""`python scripts/profile_drafting.py ...` from a checkout: the same program as `specdraft profile-drafting`
(src/specdraft/tools/profile_drafting.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
