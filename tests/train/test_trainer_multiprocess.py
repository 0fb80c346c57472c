"""Two processes (accelerate's MULTI_CPU, gloo) train exactly what one process does with the
same global batch, for every kind: the step's loss is weighted by the global token count, and the
data order depends on the global batch only (the two-model draft and Medusa-1: in
test_trainer_deepspeed.py, beside a target sharded by ZeRO-3)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from testkit import ACCELERATE, ROOT, run_script

from specdraft.train.entry import main as train_main

MEDUSA = ["drafter.num_heads=2", "drafter.loss=ce", "decode.gamma=2"]
# case -> (the training script, its settings). The two-model draft and Medusa-1 are not here:
# test_trainer_deepspeed.py's sharded-target test launches each on two plain DDP processes and
# compares with one plain process the same way (the target sharded too), which keeps the suite
# within its time on 2 cores.
KINDS = {
    # anchors are drawn from each example's index and the step (evaluation's from each row's
    # tokens), so the split into processes does not change them
    "dflash": ("dflash", ["drafter.block_size=4", "drafter.anchors=6", "decode.gamma=3"]),
    "eagle": ("eagle", ["drafter.draft_vocab_size=256", "drafter.ttt_steps=2", "decode.gamma=3"]),
    # the target's LoRA adapters train inside the drafter's forward, under DDP too (dropout 0:
    # each process draws the dropout masks of its own examples, so with dropout two processes
    # match one in distribution only)
    "medusa2": ("medusa", [*MEDUSA, "drafter.lora.rank=4", "drafter.lora.dropout=0", "drafter.target_loss=lm",
                           "drafter.heads_warmup_steps=1"]),
    # the target itself trains, with layer dropout on: each sample's skips are drawn from its
    # index in the training set, so the split into processes does not change them
    "layerskip": ("layerskip", ["drafter.exit_layer=1", "drafter.layer_dropout=0.5",
                                "drafter.dropout_scale=uniform", "decode.gamma=2"]),
    # COD's draws come from each sample's index in the training set: two processes drop the
    # slots one does
    "peagle": ("peagle", ["drafter.draft_vocab_size=256", "drafter.num_depths=3",
                          "drafter.down_sample_ratio=0.5", "decode.gamma=3"]),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_two_processes_equal_one_with_the_same_global_batch(tiny_target_path, tmp_path, kind):
    script, settings = KINDS[kind]
    common = [
        str(ROOT / "train" / f"{script}.py"), *settings, f"target={tiny_target_path}", "max_steps=4",
        "eval_loop.enabled=false",  # the weights are compared; serving them is tested elsewhere
        "eval_every=2", "eval_batches=2", "save_every=0", "data.max_samples=20",
        "data.max_length=32", "warmup_steps=1", "grad_accum=2", "seed=1",
        "mixed_precision=no",  # two equal one in fp32: bf16 rounds 2+2 rows unlike 4, any CPU
    ]  # fmt: skip
    run_script(
        [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", *common,
         "micro_batch_size=2", f"output_dir={tmp_path / 'two'}"],
        cwd=tmp_path,
    )  # fmt: skip
    # the one process: the trainer's main in this process (as compare.py runs a family),
    # which a fresh process equals bit for bit (tests/tools/test_compare.py), without one more
    # interpreter start
    assert (
        train_main(script, [*common[1:], "micro_batch_size=4", f"output_dir={tmp_path / 'one'}"])
        == 0
    )

    one, two = (
        json.loads((tmp_path / d / "checkpoint-4" / "trainer_state.json").read_text())
        for d in ("one", "two")
    )
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert [e["tau"] for e in two["evals"]] == pytest.approx(
        [e["tau"] for e in one["evals"]], rel=1e-6
    )
    # training moved the weights (the tiny target is nearly deterministic, so Medusa's heads,
    # right at the start, show it in their loss rather than their tau)
    first, last = one["evals"][0], one["evals"][-1]
    moved = last["tau"] > first["tau"] if script in ("distill", "eagle", "peagle") else True
    assert moved and last["loss"] < first["loss"]
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("one", "two"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < 1e-5, k
