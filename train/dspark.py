"""`accelerate launch train/dspark.py [--config PATH] [key=value ...]` from a checkout: the same
program as `specdraft train dspark` (src/specdraft/kinds/dspark/dspark_trainer.py, run through
src/specdraft/train/entry.py; --help lists every key)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
