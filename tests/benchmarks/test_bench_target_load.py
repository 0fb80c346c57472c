"""benchmarks/bench_target_load.py: a sharded bf16 target written by --build, then loaded whole
and as its embedding and LM head alone. Broken, it shows: the embeddings-only load holding the
decoder layers (their bytes counted), a conversion to fp32 not doubling what is held, or an
unsharded build."""

from __future__ import annotations

import bench_target_load
import pytest


def test_embeddings_only_holds_the_embedding_and_lm_head(tmp_path, capsys):
    folder = tmp_path / "big"
    argv = ["--build", str(folder), "--layers", "3", "--hidden", "256", "--vocab", "2000",
            "--shards", "2"]  # fmt: skip
    assert bench_target_load.main(argv) == 0
    assert len(list(folder.glob("model-*.safetensors"))) >= 2  # sharded
    whole = bench_target_load.measure(str(folder), False, None)
    only = bench_target_load.measure(str(folder), True, None)
    converted = bench_target_load.measure(str(folder), True, "float32")
    assert whole["dtype"] == only["dtype"] == "bfloat16" and converted["dtype"] == "float32"
    embedding_and_head = 2 * 2000 * 256 * 2 / 2**20  # two (vocab, hidden) bf16 matrices
    assert embedding_and_head <= only["weights_mib"] < embedding_and_head * 1.01
    assert whole["weights_mib"] > 1.5 * only["weights_mib"]  # 3 layers of 256 x 1024 MLPs on top
    assert converted["weights_mib"] == pytest.approx(2 * only["weights_mib"])


def test_no_folder_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_target_load.main([])
    assert "give a model folder" in capsys.readouterr().err
