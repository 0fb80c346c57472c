"""The offline hidden-state cache: the dump holds the training examples with the target's own
hidden states, offline training equals online training on the same data (same losses, same
weights), resume, bytes per token, and clear errors for another target and a damaged shard."""

from __future__ import annotations

import copy
import importlib
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from specdraft.targets.hidden_cache import (
    CachedTarget,
    HiddenCacheError,
    HiddenStateCache,
    bytes_per_token,
    ids_hash,
    write_cache,
)
from specdraft.targets.target import Target
from specdraft.tools.dump_hidden_states import main as dump
from specdraft.train.entry import main as train_main

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60))


@pytest.fixture
def run_args(tiny_target_path, tmp_path):
    data = tmp_path / "code.txt"
    data.write_text(TEXT)
    return [
        f"target={tiny_target_path}", f"data.path={data}", "data.max_length=32",
        "data.eval_fraction=0.1", "max_steps=3", "micro_batch_size=4", "eval_every=3",
        "eval_batches=1", "save_every=0", "warmup_steps=1", "lr=3e-3",
        "drafter.draft_vocab_size=200", "drafter.ttt_steps=2", "decode.gamma=2",
        "eval_loop.enabled=false",
        "mixed_precision=no",  # the cache is compared with fp32 forwards, on every CPU
    ]  # fmt: skip


def recorded_training(monkeypatch) -> list[SimpleNamespace]:
    """Each call of the EAGLE script's trainer (through train/beside_target.py): the head's
    weights before training, the examples it trained and evaluated on, and the result (its
    per-step losses)."""
    script = importlib.import_module("specdraft.train.beside_target")
    real, calls = script.train, []

    def recording(cfg, head, features, train_examples, eval_examples, **kwargs):
        start = {k: v.detach().clone() for k, v in head.state_dict().items()}
        # whether the target's decoder layers exist in memory while training
        layers = [p for n, p in features.model.named_parameters() if ".layers." in n]
        materialised = not any(p.is_meta for p in layers)
        result = real(cfg, head, features, train_examples, eval_examples, **kwargs)
        examples = [*train_examples, *eval_examples]
        calls.append(
            SimpleNamespace(
                start=start, examples=examples, result=result, materialised=materialised
            )
        )
        return result

    monkeypatch.setattr(script, "train", recording)
    return calls


@pytest.mark.exact
def test_offline_training_equals_online(tiny_target, tmp_path, run_args, capsys, monkeypatch):
    cache = tmp_path / "cache"
    assert dump(["--out", str(cache), "--dtype", "fp32", "--shard-examples", "8", *run_args]) == 0
    assert "bytes per token" in capsys.readouterr().out
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["layers"] == [1, 2]  # the tiny target's fused layers [1, 1, 1] + final state
    assert len(manifest["shards"]) >= 2
    # fp32: ids (8 bytes) + 2 layers x 64 x 4 bytes per token, plus headers
    assert 8 + 2 * 64 * 4 <= bytes_per_token(cache) < 1.2 * (8 + 2 * 64 * 4)

    runs = recorded_training(monkeypatch)
    assert train_main("eagle", [*run_args, f"output_dir={tmp_path / 'online'}"]) == 0
    online = runs[-1]

    # The dump holds exactly the examples that training reads, in its order, each with the
    # target's own hidden states: what a fresh forward of that example alone computes.
    examples = online.examples
    assert manifest["examples"] == [ids_hash(e.input_ids) for e in examples]
    stored = {}
    for shard in manifest["shards"]:
        stored.update(load_file(cache / shard["file"]))
    assert len(stored) == 3 * len(examples)  # ids and two layers per example, nothing else
    for i, e in enumerate(examples):
        assert stored[f"{i}.input_ids"].tolist() == list(e.input_ids)
        fresh = tiny_target.forward(torch.tensor([e.input_ids]), capture_layers=[1, 2])
        for layer in (1, 2):
            got, want = stored[f"{i}.layer{layer}"], fresh.hidden_states[layer][0]
            torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)

    def no_forward(*args, **kwargs):
        raise AssertionError("offline training ran the target")

    monkeypatch.setattr(Target, "forward", no_forward)
    monkeypatch.setattr(Target, "__call__", no_forward)
    assert (
        train_main(
            "eagle", [*run_args, f"output_dir={tmp_path / 'offline'}", f"hidden_cache={cache}"]
        )
        == 0
    )
    offline = runs[-1]
    # offline, only the embedding and the LM head were read: no decoder layer in memory
    assert online.materialised and not offline.materialised
    # Both runs read the same examples (token ids and loss masks) and start from the same head;
    # step by step they get the same losses, hence end with the same weights; and training moved
    # the weights, so that equality says something.
    assert offline is not online and offline.examples == examples
    for name, tensor in online.start.items():
        assert torch.equal(tensor, offline.start[name]), name
    assert len(online.result.losses) == 3
    assert offline.result.losses == pytest.approx(online.result.losses, rel=1e-5)
    online_w = load_file(tmp_path / "online" / "final" / "model.safetensors")
    offline_w = load_file(tmp_path / "offline" / "final" / "model.safetensors")
    assert online_w.keys() == offline_w.keys()
    for k in online_w:
        assert torch.allclose(online_w[k], offline_w[k], atol=1e-5), k
    moved = (online_w["fc_fuse.weight"] - online.start["fc_fuse.weight"]).abs().max()
    assert moved > 1e-4  # Adam moves a weight by up to about lr = 3e-3 per step


def test_offline_training_serves_the_head_with_the_whole_target(tmp_path, run_args):
    """Training read only the embedding and LM head; measuring the head in the loop afterwards
    loads the whole target, and decodes its plain greedy output."""
    cache = tmp_path / "cache"
    assert dump(["--out", str(cache), *run_args]) == 0
    loop = ["eval_loop.enabled=true", "eval_loop.prompts=demo", "eval_loop.num_prompts=1",
            "eval_loop.max_new_tokens=8",
            "eval_loop.threads=1"]  # fmt: skip
    out = tmp_path / "offline"
    assert (
        train_main("eagle", [*run_args, *loop, f"output_dir={out}", f"hidden_cache={cache}"]) == 0
    )
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["num_prompts"] == 1 and served["matches_ar"] is True


def other_target(tiny_target) -> Target:
    config = copy.deepcopy(tiny_target.config)
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    return Target(LlamaForCausalLM(config), tiny_target.tokenizer, name="other")


def rows(n: int = 10):
    return [SimpleNamespace(input_ids=[3 + i, 40 + i, 7, 9 + i][: 2 + i % 3]) for i in range(n)]


def test_resume_keeps_finished_shards_and_bf16_halves_the_bytes(tiny_target, tmp_path):
    examples = rows()
    folder = tmp_path / "cache"
    write_cache(folder, tiny_target, examples, [1, 2], dtype="bf16", shard_examples=4)
    first = (folder / "shard-00000.safetensors").stat().st_mtime_ns
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]  # as if killed after the first shard
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "shard-00002.safetensors").unlink()
    write_cache(folder, tiny_target, examples, [1, 2], dtype="bf16", shard_examples=4)
    assert (folder / "shard-00000.safetensors").stat().st_mtime_ns == first
    cache = HiddenStateCache(folder, tiny_target, examples, [1])
    out = tiny_target.forward(torch.tensor([examples[9].input_ids]), capture_layers=[1])
    got = cache.example(examples[9].input_ids)[1]
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), out.hidden_states[1][0], atol=0.05)
    with pytest.raises(HiddenCacheError, match="another target, layers, dtype or data"):
        write_cache(folder, tiny_target, examples, [1, 2], dtype="fp16", shard_examples=4)


def test_bad_caches_are_clear_errors(tiny_target, tmp_path):
    examples = rows()
    folder = tmp_path / "cache"
    write_cache(folder, tiny_target, examples, [1, 2], dtype="fp32", shard_examples=4)
    with pytest.raises(HiddenCacheError, match=r"another target .*num_layers: expected 2, got 3"):
        HiddenStateCache(folder, other_target(tiny_target), examples, [1])
    with pytest.raises(HiddenCacheError, match="not the 9 examples"):
        HiddenStateCache(folder, tiny_target, examples[:9], [1])
    with pytest.raises(HiddenCacheError, match=r"not \[0\]"):
        HiddenStateCache(folder, tiny_target, examples, [0])
    shard = folder / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    cache = HiddenStateCache(folder, tiny_target, examples, [1])
    cache.example(examples[0].input_ids)  # another shard still reads
    with pytest.raises(
        HiddenCacheError, match=r"shard-00001\.safetensors cannot be read.*truncated"
    ):
        cache.example(examples[5].input_ids)
    with pytest.raises(HiddenCacheError, match=r"no manifest\.json"):
        HiddenStateCache(tmp_path / "nothing", tiny_target, examples, [1])
    # a NaN in one example of an intact shard: that example fails, its neighbours still read
    shard = folder / "shard-00002.safetensors"
    tensors = load_file(shard)
    key = next(k for k in tensors if k.endswith(".layer1"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, shard)
    cache = HiddenStateCache(folder, tiny_target, examples, [1])
    bad = int(key.split(".")[0])
    with pytest.raises(HiddenCacheError, match=rf"example {bad} layer 1 has non-finite values"):
        cache.example(examples[bad].input_ids)
    cache.example(examples[bad + 1].input_ids)


def test_training_from_a_cache_places_only_the_embedding_and_lm_head(tiny_target, tmp_path):
    """Offline training needs the target's embedding and LM head, not its layers: moving the
    cache stand-in to a device moves only those (on a GPU, an 8B target's layers stay off it),
    and the target is made whole again where it must decode."""
    import copy

    target = copy.deepcopy(tiny_target)  # moved to "meta" below; the shared fixture stays whole
    examples = rows()
    write_cache(tmp_path / "c", target, examples, [1, target.num_layers])
    features = CachedTarget(target, HiddenStateCache(tmp_path / "c", target, examples, [1]))
    assert features.to("meta") is features
    assert target.model.get_input_embeddings().weight.device.type == "meta"
    assert target.model.get_output_embeddings().weight.device.type == "meta"
    layer = next(target.layers[0].parameters())
    assert layer.device.type == "cpu"  # the decoder layers did not move
    target.to("meta")
    assert next(target.layers[0].parameters()).device.type == "meta"
