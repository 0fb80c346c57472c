"""formats/checkpoint.py: the one writer and reader of drafter weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specdraft.drafters.base import CheckpointRecord, Drafter
from specdraft.formats import checkpoint
from specdraft.formats.checkpoint import CheckpointError, check_complete, save_drafter
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.kinds.distill.distill import DistillConfig, DistillDecode, DistillDrafter
from specdraft.targets.target import Target


@pytest.fixture
def student(tiny_target) -> DistillDrafter:
    torch.manual_seed(1)
    return DistillDrafter.build(DistillConfig(init="random", num_layers=1), tiny_target)


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_distill_round_trip_is_bit_exact_and_a_plain_hf_folder(tiny_target, student, tmp_path):
    folder = save_drafter(
        student, tmp_path / "final", target_fingerprint=tiny_target.fingerprint,
        train_config_yaml="lr: 0.1\n", provenance={"steps": 7}, tokenizer=tiny_target.tokenizer,
    )  # fmt: skip
    loaded = load_drafter(folder, tiny_target)
    _same_state(student, loaded)
    assert loaded.config == student.config
    assert loaded.checkpoint.target_fingerprint == tiny_target.fingerprint

    block = json.loads((folder / "config.json").read_text())["specdraft"]
    assert block["kind"] == "distill"
    assert block["format_version"] == checkpoint.FORMAT_VERSION
    assert block["config"]["num_layers"] == 1
    assert block["provenance"]["steps"] == 7 and "git_commit" in block["provenance"]
    assert (folder / "train_config.yaml").read_text() == "lr: 0.1\n"
    # A plain HF folder: transformers alone loads the same weights.
    plain = AutoModelForCausalLM.from_pretrained(folder)
    _same_state(student.hf_model, plain)


def test_saving_over_a_folder_replaces_it_whole(tiny_target, student, tmp_path):
    save_drafter(student, tmp_path / "best", target_fingerprint=tiny_target.fingerprint)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    save_drafter(student, tmp_path / "best", target_fingerprint=tiny_target.fingerprint)
    _same_state(student, load_drafter(tmp_path / "best", tiny_target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]  # no temp or old folder left


def test_loading_for_another_target_names_what_differs(tiny_target, student, tmp_path):
    folder = save_drafter(student, tmp_path / "d", target_fingerprint=tiny_target.fingerprint)
    other = Target(tiny_target.model, tiny_target.tokenizer, name="other")
    other.fingerprint = {**tiny_target.fingerprint, "num_layers": 99, "tokenizer_hash": "x"}
    with pytest.raises(CheckpointError) as err:
        load_drafter(folder, other)
    assert "num_layers: expected 2, got 99" in str(err.value)
    assert "tokenizer_hash" in str(err.value)
    # strict=False checks only the vocabulary, which matches here.
    load_drafter(folder, other, strict=False)


def test_another_checkpoint_of_the_same_shape_is_refused_by_its_weights(
    tiny_target, student, tmp_path
):
    """Architecture, sizes and tokenizer equal, embedding not (a base model for its instruct
    twin, a fine-tune): the weights hash in the fingerprint refuses it by name; strict=False
    loads it; a fingerprint saved before the hash existed still loads."""
    import copy

    folder = save_drafter(student, tmp_path / "d", target_fingerprint=tiny_target.fingerprint)
    twin = copy.deepcopy(tiny_target.model)
    with torch.no_grad():
        twin.get_input_embeddings().weight.mul_(1.5)
    other = Target(twin, tiny_target.tokenizer, name="twin")
    assert {k: v for k, v in other.fingerprint.items() if k != "weights"} == {
        k: v for k, v in tiny_target.fingerprint.items() if k != "weights"
    }
    with pytest.raises(CheckpointError, match=r"the embedding.s weights differ.*strict=False"):
        load_drafter(folder, other)
    load_drafter(folder, other, strict=False)
    old = {k: v for k, v in tiny_target.fingerprint.items() if k != "weights"}
    older = save_drafter(student, tmp_path / "old", target_fingerprint=old)
    load_drafter(older, other)


def test_incomplete_and_damaged_folders_are_refused(tiny_target, student, tmp_path):
    folder = save_drafter(student, tmp_path / "d", target_fingerprint=tiny_target.fingerprint)
    checkpoint.check_complete(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="damaged"):
        checkpoint.check_complete(folder)
    (folder / checkpoint.COMPLETE_MARKER).unlink()
    with pytest.raises(CheckpointError, match="COMPLETE"):
        load_drafter(folder, tiny_target)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_drafter(tmp_path / "nothing", tiny_target)


def test_plain_hf_folder_of_another_vocabulary_is_refused(tiny_target, tmp_path):
    config = tiny_target.model.config.__class__(
        **{**tiny_target.model.config.to_dict(), "vocab_size": 50}
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="vocabulary of 50"):
        load_drafter(tmp_path / "small", tiny_target)


# A drafter that is not an HF model (the EAGLE / Medusa shape): own tensors stored, tensors it
# shares with the target recorded but not stored.
@dataclass
class _HeadConfig:
    width: int = 8


class _HeadDrafter(Drafter):
    kind = "toyhead"
    config_class = _HeadConfig
    checkpoint = CheckpointRecord(shared_with_target=("lm_head.weight",))

    def __init__(self, config: _HeadConfig, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.width, config.width)
        self.lm_head = lm_head

    @classmethod
    def from_checkpoint(cls, config, target, hf_model):
        return cls(config, target.model.lm_head)


def test_non_hf_drafter_stores_only_its_own_tensors(tiny_target, tmp_path):
    torch.manual_seed(0)
    drafter = _HeadDrafter(_HeadConfig(width=8), tiny_target.model.lm_head)
    folder = save_drafter(drafter, tmp_path / "h", target_fingerprint=tiny_target.fingerprint)
    from safetensors.torch import load_file

    assert set(load_file(folder / "model.safetensors")) == {"proj.weight", "proj.bias"}
    loaded = load_drafter(folder, tiny_target)
    _same_state(drafter, loaded)
    assert loaded.lm_head is tiny_target.model.lm_head


def test_decoding_defaults_round_trip_and_a_folder_of_another_format_is_refused_by_name(
    tiny_target, student, tmp_path
):
    """The drafter's decoding defaults are saved beside its config and come back on load; a
    folder of an earlier format (1: decoding keys inside the kind's config; 2: before the
    package's own layout) or a newer one is an error that says which format it is and what to
    do, in one place, for loading, resuming and checking alike."""
    drafter = student
    decode = DistillDecode(gamma=7, draft_weights="int8", lookup_ngram=2)
    folder = save_drafter(
        drafter, tmp_path / "d", target_fingerprint=tiny_target.fingerprint, decode=decode
    )
    assert load_decoding(folder) == decode

    config = json.loads((folder / "config.json").read_text())
    block = config["specdraft"]
    block["decode"] = {"gamma": 0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: its decoding settings are not valid for a two-model drafter: gamma must be",
    ):
        load_drafter(folder, tiny_target)

    for version, said, fix in ((1, "checkpoint format 1", "retrain the drafter; a kind"),
                               (2, "checkpoint format 2", "retrain"),
                               (None, "no format_version", "retrain"),
                               (4, "checkpoint format 4", "Upgrade specdraft")):  # fmt: skip
        block["format_version"] = version
        (folder / "config.json").write_text(json.dumps(config))
        for read in (lambda: load_drafter(folder, tiny_target), lambda: load_decoding(folder),
                     lambda: check_complete(folder)):  # fmt: skip
            with pytest.raises(CheckpointError, match=rf"has {said}; .*format 3 only.*{fix}"):
                read()
    block["format_version"] = checkpoint.FORMAT_VERSION
    del block["decode"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no `decode` block"):
        load_drafter(folder, tiny_target)


def test_saving_over_a_folder_swaps_it_atomically_and_clears_leftovers(
    tiny_target, student, tmp_path, monkeypatch
):
    """Replacing best/ or final/ never leaves a moment without the folder: the complete new copy
    is swapped in with one atomic exchange, never by renaming the old one away first; and what
    a crash left beside the folder (a swapped-out copy) is cleared by the next save."""
    folder = tmp_path / "final"
    save = lambda: save_drafter(student, folder, target_fingerprint=tiny_target.fingerprint)  # noqa: E731
    save()
    rename = os.rename

    def guarded(src, dst, *args, **kwargs):
        assert Path(src) != folder, "the folder was renamed away: readers could find nothing"
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", guarded)
    save()
    monkeypatch.setattr(os, "rename", rename)
    _same_state(student, load_drafter(folder, tiny_target))  # the folder is whole after each save

    os.rename(folder, tmp_path / ".final.old-999")  # a crash between the fallback's two renames
    (tmp_path / ".final.old-998").mkdir()  # and an older half-removed copy
    save()
    _same_state(student, load_drafter(folder, tiny_target))  # the folder is whole after each save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
