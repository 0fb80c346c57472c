"""`python scripts/dump_hidden_states.py ...` from a checkout: the same program as `specdraft dump-hidden-states`
(src/specdraft/tools/dump_hidden_states.py; --help lists its arguments)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
