"""Setup the scripts' tests share."""

from __future__ import annotations

import copy

import pytest


@pytest.fixture(scope="module")
def draft_folder(tiny_target, tmp_path_factory):
    """A plain HF folder holding a copy of the target: a two-model drafter that is always right."""
    folder = tmp_path_factory.mktemp("draft") / "copy"
    copy.deepcopy(tiny_target.model).save_pretrained(folder)
    return folder
