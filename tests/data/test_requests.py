"""data/requests.py: chat requests from the standard library, deterministic and split by file."""

from __future__ import annotations

from collections import Counter

import pytest

from specdraft.data.requests import KINDS, stdlib_requests


def test_requests_are_deterministic_single_turn_and_spread_over_kinds():
    rows = stdlib_requests(400)
    assert rows == stdlib_requests(400)
    assert len(rows) == 400 and len({r["source"] for r in rows}) == 400
    assert all(
        [m["role"] for m in r["messages"]] == ["user"] and r["messages"][0]["content"].strip()
        for r in rows
    )
    kinds = Counter(r["source"].rsplit(":", 1)[1] for r in rows)
    assert set(kinds) == {name for name, _ in KINDS}
    # round-robin over files: 400 requests come from many files, not the first few
    assert len({r["source"].split(":")[0] for r in rows}) > 100


def test_train_and_heldout_share_no_file_and_skip_private_modules():
    files = {split: {r["source"].split(":")[0] for r in stdlib_requests(None, split)}
             for split in ("train", "heldout")}  # fmt: skip
    assert files["train"] and files["heldout"] and not files["train"] & files["heldout"]
    parts = {part for f in files["train"] | files["heldout"] for part in f.split("/")[1:]}
    assert "json" in parts and "__init__.py" in parts
    assert not [part for part in parts if part.startswith("_") and part != "__init__.py"]


def test_a_request_quotes_its_source_or_names_it():
    rows = {r["source"]: r["messages"][0]["content"] for r in stdlib_requests(None)}
    review = next(text for where, text in rows.items() if where.endswith(":review"))
    assert "```python\ndef " in review or "```python\nclass " in review
    explain = next(text for where, text in rows.items() if where.endswith(":explain"))
    assert explain.startswith("Explain what `")


def test_bad_n_is_refused():
    with pytest.raises(ValueError, match="n >= 1"):
        stdlib_requests(0)
