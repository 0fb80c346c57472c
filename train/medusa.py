"""`accelerate launch train/medusa.py [--config PATH] [key=value ...]` from a checkout: the same
program as `specdraft train medusa` (src/specdraft/train/medusa.py; --help lists every key)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
