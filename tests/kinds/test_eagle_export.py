"""kinds/eagle/eagle_export.py: EAGLE heads written in speculators' (vLLM's), SGLang's and SafeAILab's
EAGLE-1 layouts with exactly the names, shapes and config fields those loaders take; the files
computing our head's logits when run the way the engines compute them (written here from the
engines' model code, independently of our module); each folder loading back into our loop as the
head it holds; every bad input a clear error that writes nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spec_helpers import make_target, tiny_llama
from testkit import perturb

from specdraft.core import DecodeConfig, float_mask
from specdraft.formats.checkpoint import CheckpointError
from specdraft.formats.export_registry import ExportError, export_drafter
from specdraft.formats.reading import load_drafter
from specdraft.inference import generate
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.eagle.eagle_formats import validate_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why

BASE = "org/random-llama"  # the verifier as a hub id: its last part is the target's name
V = 384
LAYERS = 8  # deep enough for the engines' default fused layers (2, L // 2, L - 3)


@pytest.fixture(scope="module")
def target():
    return make_target(tiny_llama(V, seed=0, layers=LAYERS))


def noisy_head(target, version="eagle3", draft_vocab=0, seed=0, **config) -> EagleDrafter:
    """A head whose every tensor is random (norm weights too), so a swapped name or a dropped
    norm shows in the logits."""
    torch.manual_seed(seed)
    d2t = None
    if draft_vocab:  # a reduced vocabulary, in no particular order
        d2t = torch.randperm(target.vocab_size)[:draft_vocab]
    if version == "eagle3":
        config.setdefault("feature_layers", [1, 3, 4])
    head = EagleDrafter.build(
        EagleConfig(version=version, draft_vocab_size=draft_vocab, **config), target, d2t
    ).eval()
    perturb(head.parameters(), 0.3, floor=0.3)
    return head


def export(head, folder, fmt: str, **kw):
    return export_drafter(head, folder, fmt, base_model_name_or_path=BASE, **kw)


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


# --- the exact layouts -----------------------------------------------------------------------------

LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
]
EAGLE3_LAYER = [*LAYER, "input_layernorm.weight", "hidden_norm.weight"]


@pytest.mark.parametrize("draft_vocab", [100, 0])
def test_speculators_layout_is_what_vllm_loads(target, draft_vocab, tmp_path):
    head = noisy_head(target, draft_vocab=draft_vocab)
    out = export(head, tmp_path / "spec", "speculators")
    state, config = weights(out), config_of(out)
    names = {f"layers.0.{n}" for n in EAGLE3_LAYER} | {"fc.weight", "norm.weight", "lm_head.weight"}
    names.add("embed_tokens.weight")  # speculators leaves a missing one at zeros (issue 31)
    if draft_vocab:  # vLLM refuses the maps for the whole vocabulary
        names |= {"d2t", "t2d"}
    assert set(state) == names
    H, Vd = target.hidden_size, draft_vocab or V
    assert state["layers.0.self_attn.q_proj.weight"].shape == (H, 2 * H)  # reads cat(emb, feat)
    assert state["fc.weight"].shape == (H, 3 * H)
    assert state["lm_head.weight"].shape == (Vd, H)
    assert "model_type" not in config  # vLLM's detection: speculators_config, no model_type
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == Vd and config["target_hidden_size"] == H
    assert config["norm_before_residual"] is False  # always written
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # HF hidden_states ids
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == V and layer["hidden_size"] == H
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["proposal_methods"][0]["speculative_tokens"] == DecodeConfig().gamma
    assert spec["verifier"] == {"name_or_path": BASE, "architectures": ["LlamaForCausalLM"]}
    assert validate_folder(out, "speculators", V) == []


def test_the_maps_are_the_engines_offsets_and_mask(target, tmp_path):
    """target id = i + d2t[i] (int64) and t2d a bool mask whose nonzero positions are exactly
    the sorted target ids: the invariant vLLM and SGLang rely on."""
    head = noisy_head(target, draft_vocab=100)
    for fmt in ("speculators", "sglang"):
        state = weights(export(head, tmp_path / fmt, fmt))
        d2t, t2d = state["d2t"], state["t2d"]
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (V,)
        ids = torch.arange(100) + d2t
        assert torch.equal(ids, head.d2t)  # draft id i drafts target token i + d2t[i]
        assert torch.equal(ids.sort().values, t2d.nonzero().flatten())


def test_sglang_layout_is_what_specforge_exports(target, tmp_path):
    out = export(noisy_head(target), tmp_path / "sgl", "sglang")
    state, config = weights(out), config_of(out)
    names = {f"midlayer.{n}" for n in EAGLE3_LAYER}
    assert set(state) == names | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        "embed_tokens.weight"
    }
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == V
    # SGLang numbers the output of decoder layer k from 0: one less than HF's hidden_states id
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert torch.equal(state["d2t"], torch.zeros(V, dtype=torch.long))  # the identity map
    assert validate_folder(out, "sglang", V) == []


@pytest.mark.parametrize("fc_bias", [True, False])
def test_eagle1_layout_is_safeailabs(target, fc_bias, tmp_path):
    out = export(noisy_head(target, "eagle1", fc_bias=fc_bias), tmp_path / "e1", "eagle")
    state, config = weights(out), config_of(out)
    names = {f"layers.0.{n}" for n in LAYER} | {"fc.weight"} | ({"fc.bias"} if fc_bias else set())
    # no input_layernorm, no final norm, no LM head; the embedding its strict loader needs
    assert set(state) == names | {"embed_tokens.weight"}
    # and the pickle SafeAILab/EAGLE's EaModel.from_pretrained reads (it reads no other file)
    pickled = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert set(pickled) == set(state) and all(torch.equal(pickled[k], state[k]) for k in state)
    assert state["fc.weight"].shape == (target.hidden_size, 2 * target.hidden_size)
    assert config["num_hidden_layers"] == 1 and config["bias"] is fc_bias
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert validate_folder(out, "eagle", V) == []


# --- the files compute our head, read as the engines read them -----------------------------------


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """Llama's rotary embedding (rotate_half) of (heads, n, d) at positions (n,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def engine_layer(w, layer, x_in, residual, positions):
    """A Llama decoder layer from raw tensors w (names without the layer prefix) on an attention
    input x_in (already normed) and a residual stream, causal over the n positions."""
    heads, kv = layer["num_attention_heads"], layer["num_key_value_heads"]
    d = layer["head_dim"]
    n = x_in.shape[0]
    q = (x_in @ w["self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
    k = (x_in @ w["self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1)
    v = (x_in @ w["self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
    theta = layer["rope_theta"]
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
    h = residual + attn @ w["self_attn.o_proj.weight"].T
    x = rms(h, w["post_attention_layernorm.weight"], layer["rms_norm_eps"])
    mlp = F.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)
    return h + mlp @ w["mlp.down_proj.weight"].T


def engine_eagle3(folder, fmt, target, ids, hidden) -> list[torch.Tensor]:
    """Two steps of vLLM's / SGLang's Eagle3 Llama model from the folder's files: fc over the
    three fused layers; layer 0 with input_layernorm on the embedding and hidden_norm on the
    feature, the residual the feature (or its norm); the pre-norm output fed back as the next
    feature; logits = lm_head(norm(h)) scattered to target ids i + d2t[i]. (1, n, V) each."""
    state, config = weights(folder), config_of(folder)
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    w = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    eps = layer["rms_norm_eps"]
    before = config.get("norm_before_residual", False)
    if fmt == "sglang":
        ids_cfg = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    else:
        ids_cfg = config["eagle_aux_hidden_state_layer_ids"]
    Vd = config["draft_vocab_size"]
    hot = torch.arange(Vd) + state["d2t"] if "d2t" in state else torch.arange(Vd)
    feature = torch.cat([hidden[i][0] for i in ids_cfg], -1) @ state["fc.weight"].T
    emb = F.embedding(ids, state["embed_tokens.weight"])[0]  # the folder's, as speculators reads
    n = ids.shape[1]
    out = []
    for step in range(2):
        tokens = emb[step:]  # step k reads token t + 1 + k beside position t's feature
        f = feature[: n - step]
        normed = rms(f, w["hidden_norm.weight"], eps)
        x_in = torch.cat([rms(tokens, w["input_layernorm.weight"], eps), normed], -1)
        h = engine_layer(w, layer, x_in, normed if before else f, torch.arange(n - step) + step)
        logits = rms(h, state["norm.weight"], eps) @ state["lm_head.weight"].T
        full = torch.full((n - step, V), float("-inf"))
        full[:, hot] = logits
        out.append(full[None])
        feature = h  # the pre-norm state is the next step's feature
    return out


def ours(head, ids, hidden) -> list[torch.Tensor]:
    """The same two steps through our module: step 1 attends only to itself, as the engines'
    second step here does (a fresh cache per step keeps the comparison plain)."""
    n = ids.shape[1]
    feature = head.fuse(hidden)[:, :n]
    out = []
    for step in range(2):
        m = n - step
        mask = float_mask(torch.ones(m, m, dtype=torch.bool).tril(), feature.dtype)[None, None]
        positions = (torch.arange(m) + step)[None]
        h = head.step(ids[:, step:], feature[:, :m], positions, mask, None)
        logits = head.draft_logits(h)
        full = torch.full((1, m, V), float("-inf"))
        full[..., head.d2t if head.config.version == "eagle3" else torch.arange(V)] = logits
        out.append(full)
        feature = h
    return out


@pytest.mark.parametrize(
    "fmt, draft_vocab, before, layers",
    [
        ("speculators", 100, False, [1, 3, 4]),
        ("speculators", 0, True, [1, 3, 4]),
        ("sglang", 100, False, [1, 3, 4]),
        # fused in another order: the engines capture layers ascending, fc's blocks follow
        ("speculators", 100, False, [4, 1, 3]),
        ("sglang", 0, False, [5, 2, 4]),
    ],
)
def test_the_files_compute_the_heads_logits_as_the_engines_do(
    target, fmt, draft_vocab, before, layers, tmp_path
):

    head = noisy_head(
        target, draft_vocab=draft_vocab, norm_before_residual=before, feature_layers=layers
    )
    folder = export(head, tmp_path / fmt, fmt)
    ids = torch.randint(3, V, (1, 10))
    hidden = target.forward(ids, capture_layers=head.capture_layers).hidden_states
    with torch.no_grad():
        for theirs, mine in zip(engine_eagle3(folder, fmt, target, ids, hidden), ours(head, ids, hidden), strict=True):  # fmt: skip
            torch.testing.assert_close(theirs, mine, atol=2e-5, rtol=1e-4)


def test_the_eagle1_files_compute_the_heads_logits_as_the_engines_do(target, tmp_path):
    """EAGLE-1: fc (with bias) over cat(embedding, final normed feature); the layer without its
    input norm, the residual fc's output; the target's LM head on the pre-norm output."""
    head = noisy_head(target, "eagle1")
    folder = export(head, tmp_path / "e1", "eagle")
    state, layer = weights(folder), config_of(folder)
    w = {k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")}
    ids = torch.randint(3, V, (1, 10))
    hidden = target.forward(ids, capture_layers=head.capture_layers).hidden_states
    with torch.no_grad():
        x = torch.cat([F.embedding(ids, state["embed_tokens.weight"])[0], hidden[LAYERS][0]], -1)
        x = x @ state["fc.weight"].T + state["fc.bias"]
        h = engine_layer(w, layer, x, x, torch.arange(10))
        theirs = target.lm_head(h)
        torch.testing.assert_close(theirs[None], ours(head, ids, hidden)[0], atol=2e-5, rtol=1e-4)


# --- back into our loop ----------------------------------------------------------------------------

ROUND_TRIPS = {
    "speculators-reduced": ("eagle3", "speculators", 100),
    "speculators-whole": ("eagle3", "speculators", 0),
    "sglang-reduced": ("eagle3", "sglang", 100),
    "eagle": ("eagle1", "eagle", 0),
    "speculators-eagle3.1": (
        "eagle3",
        "speculators",
        100,
        dict(norm_before_fc=True, norm_output=True),
    ),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_each_folder_reloads_strictly_and_decodes_as_the_original(target, case, tmp_path):
    version, fmt, draft_vocab, *config = ROUND_TRIPS[case]
    head = noisy_head(target, version, draft_vocab, **(config[0] if config else {}))
    back = load_drafter(export(head, tmp_path / case, fmt), target)
    assert back.config == head.config
    theirs, mine = back.state_dict(), head.state_dict()
    assert set(theirs) == set(mine)
    for name in mine:
        assert torch.equal(theirs[name], mine[name]), name
    prompt = torch.randint(3, V, (12,)).tolist()
    plain = generate(target, prompt, max_new_tokens=24).tokens
    settings = dict(max_new_tokens=24, gamma=3, lookup_ngram=0)
    first, again = (
        generate(target, prompt, head, **settings),
        generate(target, prompt, back, **settings),
    )
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.tokens, plain)
    assert first.stats.drafted == again.stats.drafted > 0  # the same drafts, accepted alike
    assert first.stats.accepted == again.stats.accepted


def test_a_published_folder_with_model_prefixes_and_the_targets_embedding_loads(target, tmp_path):
    """What SpecForge and speculators also write: names under model., the embedding (equal to
    the target's), a full-vocabulary folder without maps (SGLang takes it)."""
    folder = export(noisy_head(target), tmp_path / "sgl", "sglang")
    state = weights(folder)
    del state["d2t"], state["t2d"]
    state = {f"model.{k}" if k.startswith("midlayer.") else k: v for k, v in state.items()}
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().clone()
    save_file(state, str(folder / "model.safetensors"))
    assert load_drafter(folder, target).draft_vocab_size == V


# --- bad input ---------------------------------------------------------------------------------------

EXPORT_ERRORS = {
    "EAGLE-1 to speculators": (dict(version="eagle1"), "speculators", "--format eagle"),
    "EAGLE-3 to eagle": ({}, "eagle", "--format speculators or sglang"),
    "final normed state": (dict(feature_layers=[1, 3, LAYERS]), "speculators", "final normed"),
    "embeddings to sglang": (dict(feature_layers=[0, 3, 4]), "sglang", "cannot name"),
    "a layer twice": (dict(feature_layers=[3, 3, 4]), "speculators", "a layer twice"),
    "norm_before_residual to sglang": (dict(norm_before_residual=True), "sglang", "SGLang"),
    "EAGLE-3.1 to sglang": (dict(norm_output=True), "sglang", "EAGLE-3.1 head"),
}


@pytest.mark.parametrize("case", EXPORT_ERRORS)
def test_a_head_a_format_cannot_hold_is_refused_and_nothing_is_written(target, case, tmp_path):
    config, fmt, message = EXPORT_ERRORS[case]
    version = config.pop("version", "eagle3")
    head = noisy_head(target, version, **config)
    previous = export(noisy_head(target, "eagle1"), tmp_path / "out", "eagle")
    before = weights(previous)
    with pytest.raises(ExportError, match=message):
        export(head, tmp_path / "out", fmt)
    after = weights(previous)  # the previous export is untouched, no temporary left
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def corrupt(folder, what: str) -> None:
    state, config = weights(folder), config_of(folder)
    if what == "missing weight":
        del state["layers.0.hidden_norm.weight"]
    elif what == "extra weight":
        state["layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    elif what == "wrong shape":
        state["fc.weight"] = state["fc.weight"][:, :64].contiguous()
    elif what == "d2t not distinct":
        state["d2t"][1] = state["d2t"][0] - 1  # draft ids 0 and 1 map to one target token
    elif what == "t2d disagrees":
        t2d = state["t2d"]
        t2d[t2d.nonzero()[0]] = False
        t2d[(~t2d).nonzero()[0]] = True
    elif what == "d2t out of range":
        state["d2t"][-1] = V
    elif what == "other verifier":
        config["speculators_config"]["verifier"]["name_or_path"] = "org/another-model"
    elif what == "other verifier architecture":
        config["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]
    elif what == "other layer shape":
        config["transformer_layer_config"]["num_attention_heads"] = 4
        config["transformer_layer_config"]["head_dim"] = 8
    elif what == "unsupported variant":
        config["fc_norm"] = True
    elif what == "no norm_before_residual":
        del config["norm_before_residual"]
    elif what == "layers beyond the target":
        config["eagle_aux_hidden_state_layer_ids"] = [1, 3, LAYERS]
    elif what == "other rotary":
        config["transformer_layer_config"]["rope_parameters"]["rope_theta"] = 500000.0
    elif what == "pickle only":
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / "pytorch_model.bin")
        return
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


BAD_FOLDERS = {
    "missing weight": "missing \\['layers.0.hidden_norm.weight'\\]",
    "extra weight": "unexpected \\['layers.0.self_attn.q_norm.weight'\\]",
    "wrong shape": "fc.weight has shape",
    "d2t not distinct": "distinct target tokens",
    "t2d disagrees": "t2d's nonzero positions",
    "d2t out of range": "distinct target tokens",
    "other verifier": "names the verifier 'org/another-model'",
    "other verifier architecture": "Qwen3ForCausalLM",
    "other layer shape": "num_attention_heads 4",
    "unsupported variant": "fc_norm is a variant",
    "no norm_before_residual": "norm_before_residual must be written",
    "layers beyond the target": "belongs to another target",
    "other rotary": "rope_theta 500000.0",
    "pickle only": "is a pickle, which specdraft never loads",
}


@pytest.mark.parametrize("what", BAD_FOLDERS)
def test_a_bad_folder_is_named_before_anything_is_built(target, what, tmp_path):
    folder = export(noisy_head(target, draft_vocab=100), tmp_path / "spec", "speculators")
    corrupt(folder, what)
    with pytest.raises(CheckpointError, match=BAD_FOLDERS[what]):
        load_drafter(folder, target)


def test_the_same_verifier_under_another_name_loads_when_not_strict(target, tmp_path):
    folder = export(noisy_head(target, draft_vocab=100), tmp_path / "spec", "speculators")
    corrupt(folder, "other verifier")
    assert load_drafter(folder, target, strict=False).draft_vocab_size == 100


def test_the_head_of_another_target_is_named(target, tmp_path):
    folder = export(noisy_head(target), tmp_path / "spec", "speculators")
    other = make_target(tiny_llama(V, seed=1, hidden=48, layers=LAYERS))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_drafter(folder, other)


def test_a_folder_in_no_known_layout_is_named(target, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["SomethingElse"]}))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="in none of the layouts specdraft reads"):
        load_drafter(tmp_path, target)


def test_a_folder_without_layer_ids_fuses_the_engines_default_layers(target, tmp_path):
    """SpecForge's and many published configs name no layers; the engines then fuse 2, L // 2
    and L - 3 (HF hidden-state ids), and so does the reader."""
    head = noisy_head(target, feature_layers=[2, LAYERS // 2, LAYERS - 3])
    for fmt in ("sglang", "speculators"):
        folder = export(head, tmp_path / fmt, fmt)
        config = config_of(folder)
        if fmt == "sglang":
            del config["eagle_config"]  # SpecForge's configs leave it out
        else:
            config["eagle_aux_hidden_state_layer_ids"] = None  # speculators writes null
        (folder / "config.json").write_text(json.dumps(config))
        assert load_drafter(folder, target).config.feature_layers == [2, 4, 5]


def test_a_bf16_head_keeps_float32_rotary_angles(target):
    """Cast to bf16 for decoding, the head's rotary frequencies stay float32, as the target's
    do: rounded to bf16 they put position 500's angles ~0.5 rad off."""
    head = noisy_head(target)
    positions = torch.tensor([[500]])
    before = head.rotary(torch.zeros(1), positions)[0]
    head.to(torch.bfloat16)
    assert head.rotary.inv_freq.dtype == torch.float32
    after = head.rotary(torch.zeros(1, dtype=torch.bfloat16), positions)[0]
    assert (after.float() - before).abs().max() < 0.01
