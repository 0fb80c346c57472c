"""The offline hidden-state cache: offline training equals online training on the same data,
resume, bytes per token, and clear errors for another target and a damaged shard."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from specdraft.data.hidden_cache import (
    HiddenCacheError,
    HiddenStateCache,
    bytes_per_token,
    write_cache,
)
from specdraft.drafters.target import Target
from specdraft.scripts.dump_hidden_states import main as dump
from specdraft.train.eagle import main as train

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60))


@pytest.fixture
def run_args(tiny_target_path, tmp_path):
    data = tmp_path / "code.txt"
    data.write_text(TEXT)
    return [
        f"target={tiny_target_path}", f"data.path={data}", "data.max_length=32",
        "data.eval_fraction=0.1", "max_steps=3", "micro_batch_size=4", "eval_every=3",
        "eval_batches=1", "save_every=0", "warmup_steps=1", "lr=3e-3",
        "drafter.draft_vocab_size=200", "drafter.ttt_steps=2", "drafter.tree_depth=2",
        "eval_loop.enabled=false",
    ]  # fmt: skip


def test_offline_training_equals_online(tiny_target, tmp_path, run_args, capsys, monkeypatch):
    cache = tmp_path / "cache"
    assert dump(["--out", str(cache), "--dtype", "fp32", "--shard-examples", "8", *run_args]) == 0
    assert "bytes per token" in capsys.readouterr().out
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["layers"] == [1, 2]  # the tiny target's fused layers [1, 1, 1] + final state
    assert len(manifest["shards"]) >= 2
    # fp32: ids (8 bytes) + 2 layers x 64 x 4 bytes per token, plus headers
    assert 8 + 2 * 64 * 4 <= bytes_per_token(cache) < 1.2 * (8 + 2 * 64 * 4)

    assert train([*run_args, f"output_dir={tmp_path / 'online'}"]) == 0

    def no_forward(*args, **kwargs):
        raise AssertionError("offline training ran the target")

    monkeypatch.setattr(Target, "forward", no_forward)
    monkeypatch.setattr(Target, "__call__", no_forward)
    assert train([*run_args, f"output_dir={tmp_path / 'offline'}", f"hidden_cache={cache}"]) == 0
    online = load_file(tmp_path / "online" / "final" / "model.safetensors")
    offline = load_file(tmp_path / "offline" / "final" / "model.safetensors")
    assert online.keys() == offline.keys()
    for k in online:
        assert torch.allclose(online[k], offline[k], atol=1e-5), k
    start = load_file(tmp_path / "online" / "final" / "model.safetensors")["fc_in.weight"]
    assert start.abs().sum() > 0


def other_target(tiny_target) -> Target:
    config = copy.deepcopy(tiny_target.config)
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    return Target(LlamaForCausalLM(config), tiny_target.tokenizer, name="other")


def rows(n: int = 10):
    from types import SimpleNamespace

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
