from __future__ import annotations

import pytest
import torch

from specdraft.core import fingerprint_differences
from specdraft.targets.target import Target, TargetError, load_target


def test_load_demo_tiny_by_name_is_frozen_and_fingerprinted(tiny_target_path):
    target = load_target("demo-tiny")
    assert all(not p.requires_grad for p in target.model.parameters())
    assert not target.model.training
    fp = target.fingerprint
    assert fp["architecture"] == "LlamaForCausalLM"
    assert fp["num_layers"] == target.model.config.num_hidden_layers
    assert fp["vocab_size"] == len(target.tokenizer)
    assert len(fp["tokenizer_hash"]) == 16
    assert load_target(tiny_target_path).fingerprint == fp


def test_captured_states_equal_output_hidden_states(tiny_target):
    ids = torch.randint(
        0, tiny_target.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)
    )
    layers = list(range(tiny_target.num_layers + 1))
    out = tiny_target.forward(ids, capture_layers=layers)
    ref = tiny_target.model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(out.logits, ref.logits)
    assert len(ref.hidden_states) == tiny_target.num_layers + 1
    for i in layers:
        assert torch.equal(out.hidden_states[i], ref.hidden_states[i]), f"layer {i}"
    # The last captured state is the normed one that feeds the LM head.
    assert torch.allclose(tiny_target.lm_head(out.hidden_states[-1 + len(layers)]), ref.logits)
    # Negative ids count from the end, like Python indexing.
    neg = tiny_target.forward(ids, capture_layers=[-1])
    assert torch.equal(neg.hidden_states[-1], ref.hidden_states[-1])


def test_lm_head_multiplies_rows_whatever_the_input_strides(tiny_target):
    """A slice of a batch-of-one block (DFlash's drafting slots) keeps the block's strides, and
    torch's 3-D linear on it multiplies through a copy of the whole head weight: the head is
    given 2-D rows, and the logits keep the input's leading shape."""
    block = torch.randn(
        1, 8, tiny_target.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    head = tiny_target.model.get_output_embeddings()
    seen = []
    handle = head.register_forward_pre_hook(lambda _module, args: seen.append(args[0].dim()))
    try:
        for h in (block[:, 1:8], block[:, :1], block[0], block[:, 8:]):
            logits = tiny_target.lm_head(h)
            assert logits.shape == (*h.shape[:-1], tiny_target.vocab_size)
            assert torch.allclose(logits, head(h.contiguous()), atol=1e-6)
    finally:
        handle.remove()
    assert seen[::2] == [2, 2, 2, 2]  # the calls lm_head made (the reference calls between)


def test_embed_matches_model_embedding(tiny_target):
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(tiny_target.embed(ids), tiny_target.model.model.embed_tokens(ids))


def test_layer_id_out_of_range_names_the_range(tiny_target):
    with pytest.raises(
        TargetError, match=r"layer id 99 is out of range .* 0 \(embeddings\) \.\. 2"
    ):
        tiny_target.forward(torch.tensor([[1, 2]]), capture_layers=[99])


def test_llama_layout_exposed_and_other_families_rejected(tiny_target):
    assert len(tiny_target.layers) == tiny_target.num_layers
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    other = Target(gpt2, tiny_target.tokenizer)
    with pytest.raises(TargetError, match="Llama-style layout"):
        _ = other.layers
    # Hidden-state capture still works there, through output_hidden_states.
    out = other.forward(torch.tensor([[1, 2, 3]]), capture_layers=[1])
    assert out.hidden_states[1].shape == (1, 3, 32)


def test_fingerprint_differences_name_the_field(tiny_target):
    other = dict(tiny_target.fingerprint, hidden_size=1)
    diffs = fingerprint_differences(tiny_target.fingerprint, other)
    assert diffs == [f"hidden_size: expected {tiny_target.hidden_size}, got 1"]


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        load_target(str(tmp_path / "nope"))


@pytest.mark.parametrize("layout", ["tied, one file", "untied, sharded"])
def test_embeddings_only_reads_the_embedding_and_lm_head_and_nothing_else(
    tiny_target, tiny_target_path, tmp_path, layout
):
    """What offline EAGLE training loads: the same embedding, LM head and fingerprint as the
    whole target, and every decoder weight left on the meta device (no memory)."""
    path = tiny_target_path
    if layout == "untied, sharded":  # an untied copy saved in shards, as large models are
        from transformers import LlamaForCausalLM

        config = tiny_target.config.__class__(**{**tiny_target.config.to_dict(), "tie_word_embeddings": False})  # fmt: skip
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        path = str(tmp_path / "sharded")
        model.save_pretrained(path, max_shard_size="100KB")
        tiny_target.tokenizer.save_pretrained(path)
        assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    whole, lite = load_target(path), load_target(path, embeddings_only=True)
    assert lite.fingerprint == whole.fingerprint
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(lite.embed(ids), whole.embed(ids))
    h = torch.randn(2, whole.hidden_size)
    assert torch.equal(lite.lm_head(h), whole.lm_head(h))
    layers = [p for n, p in lite.model.named_parameters() if ".layers." in n]
    assert layers and all(p.is_meta for p in layers)
    # an EAGLE-3 head built from the copy keeps what it read of the LM head; the copy's own LM
    # head can then go (a sharded run's), unless it is the embedding itself
    from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter, resolve_config

    cfg = resolve_config(EagleConfig(version="eagle3", draft_vocab_size=64), lite)
    torch.manual_seed(0)
    head = EagleDrafter.build(cfg, lite, torch.arange(64))
    rows = whole.model.get_output_embeddings().weight[:64].float()
    lite.release_lm_head()
    tied = layout.startswith("tied")
    assert lite.model.get_output_embeddings().weight.is_meta is not tied
    assert not lite.model.get_input_embeddings().weight.is_meta
    assert torch.equal(head.lm_head.weight, rows)
    batch = {"input_ids": torch.tensor([[3, 4, 5, 6, 7]])}
    batch |= {"attention_mask": torch.ones_like(batch["input_ids"]), "loss_mask": torch.ones_like(batch["input_ids"])}  # fmt: skip
    out = whole.forward(batch["input_ids"], capture_layers=head.capture_layers)
    loss, _ = head(batch, out)
    assert torch.isfinite(loss)
