"""DSpark drafters in vllm-project/speculators' layout (which vLLM serves as `dspark`, and
llama.cpp's converter reads for `draft-dspark`), and read back.

A DSpark folder is a DFlash folder (kinds/dflash/dflash_export.py: the backbone's config fields
and weight names, fc's feature blocks in ascending layer order) with speculators 0.9.0's
DSparkSpeculatorConfig fields and its heads' weights:

    config.json        speculators_model_type dspark, architectures [DSparkSpeculator],
                       sample_from_anchor (true: the anchor's slot drafts, block_size tokens a
                       block), markov_rank, markov_head_type vanilla, enable_confidence_head,
                       confidence_head_with_markov true, speculators_config.algorithm dspark,
                       speculative_tokens min(gamma, the tokens a block drafts)
    model.safetensors  DFlash's, and markov_head.markov_w1.weight (vocab, rank),
                       markov_head.markov_w2.weight (vocab, rank), and with the confidence head
                       confidence_head.proj.weight (1, hidden + rank) and .bias (1,)
"""

from __future__ import annotations

from functools import partial

from specdraft.core import DecodeConfig
from specdraft.formats.export_formats import Held, integer
from specdraft.kinds.dflash import dflash_export
from specdraft.kinds.dspark.dspark import DSparkDrafter

ARCHITECTURE = "DSparkSpeculator"


def write_speculators(
    drafter: DSparkDrafter, base_model: str, decode: DecodeConfig
) -> tuple[dict, dict]:
    """(config.json, the weights) of a DSpark drafter in speculators' layout."""
    config, state = dflash_export.write_speculators(drafter, base_model, decode)
    cfg = drafter.config
    config.update(
        architectures=[ARCHITECTURE],
        speculators_model_type="dspark",
        sample_from_anchor=cfg.sample_from_anchor,
        markov_rank=cfg.markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=cfg.enable_confidence_head,
        confidence_head_with_markov=cfg.enable_confidence_head,
    )
    config["speculators_config"]["algorithm"] = "dspark"
    return config, state


def layout_problems(config: dict, names: set[str] | None = None) -> list[str]:
    """DFlash's backbone rules for a dspark folder, and its heads': [] when it loads."""
    problems = dflash_export.layout_problems(config, names, model_type="dspark")
    if not integer(config.get("markov_rank")):
        problems.append(
            "markov_rank must be an integer >= 1 (a DSpark folder without a Markov head is a "
            "DFlash drafter)"
        )
    if config.get("markov_head_type", "vanilla") != "vanilla":
        problems.append(
            f"markov_head_type {config['markov_head_type']!r} is a variant specdraft's drafter "
            "does not compute (it computes vanilla, the one llama.cpp serves)"
        )
    confidence = config.get("enable_confidence_head", True)
    if confidence and config.get("confidence_head_with_markov", True) is not True:
        problems.append(
            "confidence_head_with_markov false is a variant specdraft's drafter does not compute "
            "(its confidence head reads the slot's state and W1 of the token before it)"
        )
    return problems


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The exact weight names and shapes of a DSpark folder with this config.json."""
    shapes = dflash_export.expected_shapes(config)
    H = config["transformer_layer_config"]["hidden_size"]
    V, rank = config["draft_vocab_size"], config["markov_rank"]
    shapes["markov_head.markov_w1.weight"] = (V, rank)
    shapes["markov_head.markov_w2.weight"] = (V, rank)
    if config.get("enable_confidence_head", True):
        shapes["confidence_head.proj.weight"] = (1, H + rank)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


# DFlash's reader and check, with the heads' rules and shapes and the fields DSparkConfig adds
SPECULATORS = Held(
    DSparkDrafter.kind,
    ARCHITECTURE,
    write_speculators,
    partial(
        dflash_export.read_drafter,
        drafter_class=DSparkDrafter,
        problems_of=layout_problems,
        shapes_of=expected_shapes,
        fields=("sample_from_anchor", "markov_rank", "enable_confidence_head"),
    ),
    partial(dflash_export.validate_folder, problems_of=layout_problems, shapes_of=expected_shapes),
)
