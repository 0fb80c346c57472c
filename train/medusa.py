"""`accelerate launch train/medusa.py [--config PATH] [key=value ...]` from a checkout: the same
program as `specdraft train medusa` (src/specdraft/kinds/medusa/medusa_trainer.py, run through
src/specdraft/train/entry.py; --help lists every key)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
