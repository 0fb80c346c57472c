"""kinds/peagle/peagle_export.py: P-EAGLE heads written in speculators' layout (PEagleSpeculator) with
the fields and weights speculators 0.9.0's PEagleSpeculatorConfig and PEagleDraftModel hold, read
back into our loop with identical drafts; bad folders named before anything is built."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_helpers import make_target, tiny_llama
from testkit import perturb

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CheckpointError
from specdraft.formats.export_registry import ExportError, export_drafter
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.inference import generate
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter, PEagleSession
from specdraft.kinds.peagle.peagle_export import validate_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why

BASE = "org/random-llama"
V = 384
K = 4


@pytest.fixture(scope="module")
def target():
    return make_target(tiny_llama(V, seed=0, layers=8))


def noisy_head(target, draft_vocab=100) -> PEagleDrafter:
    """Every tensor random (norms and mask_hidden too), the fused layers given out of order, so a
    block written in the wrong order shows in the drafts."""
    torch.manual_seed(0)
    d2t = torch.randperm(V)[:draft_vocab] if draft_vocab else None
    cfg = PEagleConfig(num_depths=K, draft_vocab_size=draft_vocab, feature_layers=[4, 1, 3])
    head = PEagleDrafter.build(cfg, target, d2t).eval()
    perturb(head.parameters(), 0.3, floor=0.3)
    return head


def export(head, folder, gamma=3):
    return export_drafter(
        head, folder, "speculators", base_model_name_or_path=BASE, decode=DecodeConfig(gamma=gamma)
    )


def test_the_folder_is_speculators_peagle_layout(target, tmp_path):
    head = noisy_head(target)
    export(head, tmp_path / "s", gamma=6)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["architectures"] == ["PEagleSpeculator"]
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["mask_token_id"] == head.config.mask_token_id
    assert config["embed_requires_grad"] is False and config["num_depths"] == K
    # the chain served: gamma capped at K
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    state = load_file(tmp_path / "s" / "model.safetensors")
    H = target.hidden_size
    assert state["mask_hidden"].shape == (1, 1, 3 * H)
    # mask_hidden's blocks follow fc's columns: the fused layers in ascending order
    blocks = head.mask_hidden.detach().split(H, dim=-1)  # layers 4, 1, 3
    assert torch.equal(state["mask_hidden"], torch.cat([blocks[1], blocks[2], blocks[0]], -1))
    eagle3 = {"fc.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight"}
    assert eagle3 < state.keys()
    assert validate_folder(tmp_path / "s", V) == []


@pytest.mark.parametrize("draft_vocab", [100, 0])
def test_the_folder_reads_back_with_identical_drafts(target, draft_vocab, tmp_path, monkeypatch):
    head = noisy_head(target, draft_vocab)
    export(head, tmp_path / "s")
    back = load_drafter(tmp_path / "s", target)
    assert isinstance(back, PEagleDrafter) and back.config.num_depths == K
    assert back.config.mask_token_id == head.config.mask_token_id
    decode = load_decoding(tmp_path / "s")
    assert decode.gamma == 3
    trees = []
    propose = PEagleSession.propose
    monkeypatch.setattr(
        PEagleSession, "propose", lambda s, ctxs: trees.extend(propose(s, ctxs)) or trees[-1:]
    )
    runs = []
    for drafter in (head, back):
        trees.clear()
        out = generate(target, [5, 17, 42, 99, 7], drafter, max_new_tokens=12, decode=decode)
        runs.append((out.tokens, [t.tokens.tolist() for t in trees]))
    (ours, our_drafts), (theirs, their_drafts) = runs
    assert torch.equal(ours, theirs) and our_drafts == their_drafts
    assert sum(len(d[0]) for d in our_drafts) > 0  # drafts were made


def test_other_layouts_refuse_a_peagle_head_and_write_nothing(target, tmp_path):
    with pytest.raises(ExportError, match="not a peagle one"):
        export_drafter(noisy_head(target), tmp_path / "g", "sglang", base_model_name_or_path=BASE)
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda c: c.pop("mask_token_id"), "mask_token_id must be a token id"),
        (lambda c: c.update(mask_token_id=V), f"mask_token_id {V} is outside"),
        (lambda c: c.update(architectures=["Eagle3Speculator"]), "PEagleSpeculator"),
        (lambda c: c.update(num_depths=1), "num_depths (K) must be an integer >= 2"),
    ],
    ids=["no-mask-token", "mask-token-outside", "architecture", "one-depth"],
)
def test_a_bad_folder_is_named_before_anything_is_built(target, tmp_path, edit, said):
    export(noisy_head(target), tmp_path / "s")
    path = tmp_path / "s" / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not a loadable P-EAGLE head") as err:
        load_drafter(tmp_path / "s", target)
    assert said in str(err.value)
    assert any(said in p for p in validate_folder(tmp_path / "s", V))


def test_a_head_without_mask_hidden_is_named(target, tmp_path):
    export(noisy_head(target), tmp_path / "s")
    weights = tmp_path / "s" / "model.safetensors"
    state = load_file(weights)
    del state["mask_hidden"]
    save_file(state, weights)
    with pytest.raises(CheckpointError, match="mask_hidden"):
        load_drafter(tmp_path / "s", target)
