"""train/launch.py: the DeepSpeed config file the shipped accelerate configs name is found from
any directory (an installed package has no checkout to launch from)."""

from __future__ import annotations

import os

import pytest

from specdraft.config import SHIPPED_CONFIGS
from specdraft.train.launch import find_shipped_deepspeed_config

ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def test_the_shipped_relative_path_is_read_from_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    monkeypatch.setenv(ENV, "configs/deepspeed/zero2.json")
    find_shipped_deepspeed_config()
    assert (SHIPPED_CONFIGS / "deepspeed" / "zero2.json").samefile(os.environ[ENV])


@pytest.mark.parametrize("given", ["configs/deepspeed/none.json", "mine.json", "none"])
def test_other_files_are_left_for_accelerate_to_report(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV, given)
    find_shipped_deepspeed_config()
    assert os.environ[ENV] == given


def test_a_file_where_the_run_was_launched_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs" / "deepspeed").mkdir(parents=True)
    (tmp_path / "configs" / "deepspeed" / "zero2.json").write_text("{}")
    monkeypatch.setenv(ENV, "configs/deepspeed/zero2.json")
    find_shipped_deepspeed_config()
    assert os.environ[ENV] == "configs/deepspeed/zero2.json"
