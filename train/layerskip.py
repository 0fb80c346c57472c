"""`accelerate launch train/layerskip.py [--config PATH] [key=value ...]` from a checkout: the same
program as `specdraft train layerskip` (src/specdraft/kinds/layerskip/layerskip_trainer.py, run through
src/specdraft/train/entry.py; --help lists every key)."""

if __name__ == "__main__":
    from specdraft.cli import launch

    launch(__file__)
