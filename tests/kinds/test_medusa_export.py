"""kinds/medusa/medusa_export.py: Medusa heads written in FasterDecoding/Medusa's and vLLM's layouts with
exactly the names and shapes those readers take, the files computing our heads' logits when read
the way the engines read them, published folders loading into our loop as the heads they hold,
and every bad input a clear error that writes nothing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spec_helpers import MEDUSA_PROMPTS, fitted_medusa_heads, make_target, tiny_llama
from testkit import perturb

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CheckpointError
from specdraft.formats.export_registry import ExportError, export_drafter
from specdraft.formats.reading import load_drafter
from specdraft.inference import generate
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig, MedusaDecode
from specdraft.kinds.medusa.medusa_export import medusa_choices

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why

BASE = "org/base-model"


def noisy_heads(target, seed: int = 0, scale: float = 0.3, d2t=None, **config) -> MedusaDrafter:
    """Heads with random block weights (and output layers, with output=own): every tensor a
    format writes differs from every other, so a swapped name shows."""
    torch.manual_seed(seed)
    heads = MedusaDrafter.build(MedusaConfig(**config), target, d2t).eval()
    perturb(heads.parameters(), scale, floor=0.1)
    return heads


def every_other_token(target, n: int) -> torch.Tensor:
    """A reduced draft vocabulary: some of the target's tokens are missing."""
    return torch.arange(1, target.vocab_size, 2)[:n]


def export(heads, folder, fmt: str, **kw):
    return export_drafter(heads, folder, fmt, base_model_name_or_path=BASE, **kw)


def target_logits(heads: MedusaDrafter, h: torch.Tensor) -> torch.Tensor:
    """(K, ..., vocab) the heads' logits over the target's vocabulary, -inf where they cannot
    draft."""
    logits = heads.logits(h)
    full = torch.full((*logits.shape[:-1], heads.target.vocab_size), float("-inf"))
    full[..., heads.d2t] = logits
    return full


# --- the exact layouts ---------------------------------------------------------------------------


def test_medusa_choices_fit_the_head_count_and_the_budget():
    """The reference's [1, k_1, ..., k_K]: one entry per head, the cartesian tree's nodes
    (k_1 + k_1 k_2 + ..., every level counted) within tree_budget, tree_top_k per head from the
    first."""
    assert medusa_choices(4, DecodeConfig()) == [1, 1, 1, 1, 1]
    assert medusa_choices(4, DecodeConfig(tree_top_k=3, tree_budget=12)) == [1, 3, 1, 1, 1]
    assert medusa_choices(3, DecodeConfig(tree_top_k=2, tree_budget=12)) == [1, 2, 2, 1]
    assert medusa_choices(2, DecodeConfig(tree_top_k=4, tree_budget=64)) == [1, 4, 4]
    assert medusa_choices(3, DecodeConfig(tree_top_k=5, tree_budget=4)) == [1, 1, 1, 1]


@pytest.mark.parametrize("output", ["own", "shared"])
def test_medusa_layout_has_the_reference_names_and_shapes(random_target, output, tmp_path):
    K, L, H, V = 3, 2, random_target.hidden_size, random_target.vocab_size
    heads = noisy_heads(random_target, num_heads=K, num_layers=L, output=output)
    out = export(heads, tmp_path / "medusa", "medusa")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "medusa_lm_head.pt", "medusa_lm_head.safetensors",
    ]  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config.pop("specdraft_decoding") == dataclasses.asdict(MedusaDecode())
    assert config == {
        "medusa_num_heads": K,
        "medusa_num_layers": L,
        "base_model_name_or_path": BASE,
        "hidden_size": H,
        "vocab_size": V,
        # one entry per head (the reference indexes one per head: its default [1, 7, 6] fits
        # two heads and raised IndexError with more); a chain at DecodeConfig()'s tree_top_k 1
        "medusa_choices": [1, 1, 1, 1],
    }
    state = load_file(out / "medusa_lm_head.safetensors")
    # the copy the reference's own loader unpickles holds the same tensors (read here as
    # tensors only; specdraft never unpickles)
    pickled = torch.load(out / "medusa_lm_head.pt", weights_only=True)
    assert pickled.keys() == state.keys() and all(torch.equal(pickled[k], state[k]) for k in state)
    expected = {}
    for h in range(K):
        for i in range(L):
            expected[f"{h}.{i}.linear.weight"] = (H, H)
            expected[f"{h}.{i}.linear.bias"] = (H,)
        expected[f"{h}.{L}.weight"] = (V, H)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    lm = random_target.model.get_output_embeddings().weight
    for h, head in enumerate(heads.heads):
        for i, block in enumerate(head.blocks):
            assert torch.equal(state[f"{h}.{i}.linear.weight"], block.linear.weight)
            assert torch.equal(state[f"{h}.{i}.linear.bias"], block.linear.bias)
        assert torch.equal(state[f"{h}.{L}.weight"], lm if output == "shared" else head.out.weight)


@pytest.mark.parametrize("case", ["own", "shared", "draft-vocab"])
def test_vllm_layout_has_the_names_and_shapes_vllm_loads(random_target, case, tmp_path):
    K, L, H, V = 3, 2, random_target.hidden_size, random_target.vocab_size
    Vd = 100 if case == "draft-vocab" else V
    d2t = every_other_token(random_target, Vd) if case == "draft-vocab" else None
    heads = noisy_heads(
        random_target, num_heads=K, num_layers=L, d2t=d2t,
        output="shared" if case == "shared" else "own", draft_vocab_size=Vd if d2t is not None else 0,
    )  # fmt: skip
    out = export(heads, tmp_path / "vllm", "vllm")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    # vLLM's MedusaConfig renames keys holding "num" and "heads": this one holds neither
    assert config.pop("specdraft_decoding") == dataclasses.asdict(MedusaDecode())
    assert config == {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": K,
        "num_hidden_layers": L,
        "truncated_vocab_size": Vd,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        "base_model_name_or_path": BASE,
    }
    state = load_file(out / "model.safetensors")
    expected = {}
    for h in range(K):
        for i in range(L):
            expected[f"blocks.{h}.layers.{i}.weight"] = (H, H)
            expected[f"blocks.{h}.layers.{i}.bias"] = (H,)
        expected[f"lm_heads.{h}.weight"] = (Vd, H)
    if d2t is not None:
        expected["token_map"] = (Vd,)
        assert torch.equal(state["token_map"], d2t) and state["token_map"].dtype == torch.long
    assert {k: tuple(v.shape) for k, v in state.items()} == expected


def engine_logits(folder, fmt: str, h: torch.Tensor) -> torch.Tensor:
    """(K, ..., vocab) logits from the files alone, the names spelled as the engines spell them:
    FasterDecoding/Medusa's nn.Sequential(*blocks, out) state dict, and vLLM's Medusa model
    (blocks.{h}.layers.{l}, lm_heads.{h}, token_map scattered over -inf)."""
    config = json.loads((folder / "config.json").read_text())
    if fmt == "medusa":
        s = load_file(folder / "medusa_lm_head.safetensors")
        K, L = config["medusa_num_heads"], config["medusa_num_layers"]
        block = lambda k, i: (s[f"{k}.{i}.linear.weight"], s[f"{k}.{i}.linear.bias"])  # noqa: E731
        out = lambda k: s[f"{k}.{L}.weight"]  # noqa: E731
    else:
        s = load_file(folder / "model.safetensors")
        K, L = config["num_heads"], config["num_hidden_layers"]
        block = lambda k, i: (s[f"blocks.{k}.layers.{i}.weight"], s[f"blocks.{k}.layers.{i}.bias"])  # noqa: E731
        out = lambda k: s[f"lm_heads.{k}.weight"]  # noqa: E731
    heads = []
    for k in range(K):
        x = h
        for i in range(L):
            x = x + F.silu(F.linear(x, *block(k, i)))
        logits = F.linear(x, out(k))
        if "token_map" in s and config["truncated_vocab_size"] < config["vocab_size"]:
            full = torch.full((*logits.shape[:-1], config["vocab_size"]), float("-inf"))
            full[..., s["token_map"]] = logits
            logits = full
        heads.append(logits)
    return torch.stack(heads)


READ_BACK = {
    "medusa-own": ("medusa", dict(output="own")),
    "medusa-shared": ("medusa", dict(output="shared")),
    "vllm-own": ("vllm", dict(output="own")),
    "vllm-shared": ("vllm", dict(output="shared")),
    "vllm-draft-vocab": ("vllm", dict(output="own", draft_vocab_size=100)),
}


@pytest.mark.parametrize("case", READ_BACK)
def test_the_files_and_the_reloaded_heads_give_the_original_logits(random_target, case, tmp_path):
    fmt, config = READ_BACK[case]
    d2t = every_other_token(random_target, 100) if config.get("draft_vocab_size") else None
    heads = noisy_heads(random_target, num_heads=3, num_layers=2, d2t=d2t, **config)
    out = export(heads, tmp_path / case, fmt)
    h = torch.randn(5, random_target.hidden_size)
    expected = target_logits(heads, h)
    torch.testing.assert_close(engine_logits(out, fmt, h), expected, rtol=1e-5, atol=1e-5)

    loaded = load_drafter(out, random_target)
    assert isinstance(loaded, MedusaDrafter) and loaded.config.output == "own"
    assert (loaded.config.num_heads, loaded.config.num_layers) == (3, 2)
    assert torch.equal(loaded.d2t, heads.d2t)
    torch.testing.assert_close(target_logits(loaded, h), expected, rtol=1e-5, atol=1e-5)


def fitted_heads(target, measure: bool = False) -> MedusaDrafter:
    """Fitted heads whose drafts are often accepted; measured (their tree from their per-rank
    accuracies) or not (an assumed tree)."""
    return fitted_medusa_heads(
        target, dict(num_heads=4), prompts=MEDUSA_PROMPTS[:2], steps=40, measure=measure
    )


@pytest.mark.parametrize("fmt, measure", [("medusa", False), ("medusa", True), ("vllm", True)])
def test_a_reference_folder_decodes_in_our_loop_as_the_original(
    random_target, fmt, measure, tmp_path
):
    """Greedy output is the target's whatever the heads are, so the drafts are compared too:
    the reloaded heads propose the same trees, accepted the same way. Measured heads carry
    their accuracies in the export (specdraft_medusa_accuracy), so the tree built from them is
    the same; without it the reloaded heads drew an assumed tree."""
    heads = fitted_heads(random_target, measure)
    loaded = load_drafter(export(heads, tmp_path / fmt, fmt), random_target)
    if measure:
        for greedy in (True, False):
            assert torch.equal(loaded.measured_accuracy(greedy), heads.measured_accuracy(greedy))
    decoding = dict(max_new_tokens=40, tree_top_k=4, tree_budget=8, gamma=4)
    accepted = 0
    for prompt in MEDUSA_PROMPTS[:2]:
        a = generate(random_target, prompt, heads, **decoding)
        b = generate(random_target, prompt, loaded, **decoding)
        assert b.tokens.tolist() == a.tokens.tolist()
        assert b.stats.accepted_at == a.stats.accepted_at
        assert b.stats.emitted_per_pass == a.stats.emitted_per_pass
        assert b.stats.drafted == a.stats.drafted
        accepted += a.stats.accepted
    assert accepted > 0  # not vacuous: the heads' drafts were taken


def test_a_published_vllm_folder_with_one_lm_head_and_a_full_vocab_token_map(
    random_target, tmp_path
):
    """vLLM's other spellings: original_lm_head (one LM head for all heads, `lm_head.weight`),
    no block bias, a `medusa_heads.` prefix, and a whole-vocabulary LM head cut to token_map."""
    H, V, K = random_target.hidden_size, random_target.vocab_size, 2
    torch.manual_seed(0)
    token_map = torch.randperm(V)[:50]
    state = {f"medusa_heads.blocks.{h}.layers.0.weight": torch.randn(H, H) for h in range(K)}
    state["lm_head.weight"] = torch.randn(V, H)
    state["token_map"] = token_map
    folder = tmp_path / "published"
    folder.mkdir()
    save_file(state, str(folder / "model-00001.safetensors"))
    config = {"model_type": "medusa", "hidden_size": H, "vocab_size": V, "medusa_num_heads": K,
              "medusa_num_layers": 1, "truncated_vocab_size": 50, "original_lm_head": True}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(folder, random_target)
    assert torch.equal(loaded.d2t, token_map)
    h = torch.randn(3, H)
    for k in range(K):
        w = state[f"medusa_heads.blocks.{k}.layers.0.weight"]
        x = h + F.silu(h @ w.T)
        expected = x @ state["lm_head.weight"][token_map].T
        torch.testing.assert_close(loaded.logits(h)[k], expected, rtol=1e-5, atol=1e-5)


def test_exporting_over_a_previous_export_replaces_it_whole(random_target, tmp_path):
    heads = noisy_heads(random_target, num_heads=2)
    out = export(heads, tmp_path / "out", "medusa")
    export(heads, out, "vllm")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old folder left


# --- bad inputs: a clear error, nothing written ------------------------------------------------------


def listing(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_exporting_into_an_unrelated_folder_is_refused_unless_asked(random_target, tmp_path):
    heads = noisy_heads(random_target, num_heads=2)
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = listing(tmp_path)
    with pytest.raises(ExportError, match=r"not empty.*notes\.txt.*--force"):
        export(heads, out, "medusa")
    assert listing(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
    export(heads, out, "medusa", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "medusa_lm_head.pt", "medusa_lm_head.safetensors",
    ]  # fmt: skip


def test_a_reduced_vocabulary_cannot_be_written_in_the_medusa_layout(random_target, tmp_path):
    d2t = every_other_token(random_target, 100)
    heads = noisy_heads(random_target, num_heads=2, draft_vocab_size=100, d2t=d2t)
    with pytest.raises(ExportError, match=r"no token map.*--format vllm.*draft_vocab_size=0"):
        export(heads, tmp_path / "out", "medusa")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def reference_folder(random_target, tmp_path):
    heads = noisy_heads(random_target, num_heads=3, num_layers=1)
    return export(heads, tmp_path / "medusa", "medusa")


def rewrite(folder, change) -> None:
    file = folder / "medusa_lm_head.safetensors"
    state = load_file(file)
    change(state)
    save_file(state, str(file))


BAD_WEIGHTS = {
    "missing name": (lambda s: s.pop("1.0.linear.bias"), r"missing \['1\.0\.linear\.bias'\]"),
    "extra name": (
        lambda s: s.update({"3.0.linear.weight": s["0.0.linear.weight"].clone()}),
        r"unexpected \['3\.0\.linear\.weight'\]",
    ),
    "wrong shape": (
        lambda s: s.update({"2.1.weight": s["2.1.weight"][:-1].clone()}),
        r"2\.1\.weight has shape \(383, 32\), expected \(384, 32\)",
    ),
}


@pytest.mark.parametrize("case", BAD_WEIGHTS)
def test_weights_that_do_not_fit_the_config_are_named(random_target, reference_folder, case):
    change, message = BAD_WEIGHTS[case]
    rewrite(reference_folder, change)
    before = listing(reference_folder)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(reference_folder, random_target)
    assert listing(reference_folder) == before


def test_heads_for_another_hidden_size_are_refused(reference_folder):
    narrow = make_target(tiny_llama(384, seed=3, hidden=16))
    with pytest.raises(
        CheckpointError, match=r"hidden_size=32.*has hidden_size=16.*org/base-model"
    ):
        load_drafter(reference_folder, narrow)


def test_a_pickle_only_folder_is_never_unpickled(random_target, reference_folder, monkeypatch):
    file = reference_folder / "medusa_lm_head.safetensors"
    torch.save(load_file(file), reference_folder / "medusa_lm_head.pt")
    file.unlink()
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    with pytest.raises(CheckpointError, match=r"medusa_lm_head\.pt is a pickle.*save_file"):
        load_drafter(reference_folder, random_target)
    assert sorted(p.name for p in reference_folder.iterdir()) == [
        "config.json", "medusa_lm_head.pt",
    ]  # fmt: skip


def test_a_vllm_folder_without_its_token_map_is_named(random_target, tmp_path):
    d2t = every_other_token(random_target, 100)
    heads = noisy_heads(random_target, num_heads=2, draft_vocab_size=100, d2t=d2t)
    out = export(heads, tmp_path / "vllm", "vllm")
    state = load_file(out / "model.safetensors")
    del state["token_map"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['token_map'\]"):
        load_drafter(out, random_target)


def test_a_damaged_accuracy_block_is_named_with_the_fix(random_target, tmp_path):
    heads = fitted_heads(random_target, measure=True)
    folder = export(heads, tmp_path / "medusa", "medusa")
    config = json.loads((folder / "config.json").read_text())
    config["specdraft_medusa_accuracy"]["greedy"] = config["specdraft_medusa_accuracy"]["greedy"][
        :2
    ]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"specdraft_medusa_accuracy must hold.*delete the key"
    ):
        load_drafter(folder, random_target)
