"""The target: a frozen Hugging Face causal LM in every form the loop and the trainer use it
(`Target`, `load_target`; sharded, embeddings-only, fine-tuned with an adapter), and the demo
target's build recipe (targets/demo_target.py)."""

from specdraft.targets.target import Target, load_target

__all__ = ["Target", "load_target"]
