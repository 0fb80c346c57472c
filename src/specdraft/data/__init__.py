"""Training data: rows from files or the hub, conversations with assistant-only loss masks, packed
plain text. Trainers call `build_datasets(cfg, tokenizer)`; evaluation takes `demo_prompts(n)`."""

from specdraft.data.chat import ChatTemplateError
from specdraft.data.data_config import DataConfig
from specdraft.data.dataset import DataSummary, build_datasets
from specdraft.data.formats import Example
from specdraft.data.sources import DataError
from specdraft.data.stdlib_corpus import demo_prompts

__all__ = [
    "ChatTemplateError",
    "DataConfig",
    "DataError",
    "DataSummary",
    "Example",
    "build_datasets",
    "demo_prompts",
]
