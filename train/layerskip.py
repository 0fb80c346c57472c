"""`accelerate launch train/layerskip.py [--config PATH] [key=value ...]` from a checkout: the same
program as `specdraft train layerskip` (src/specdraft/train/layerskip.py; --help lists every key)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
