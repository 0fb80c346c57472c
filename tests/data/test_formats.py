"""Every row format reads into the same conversation; every kind of bad row is skipped with a
reason that names the problem."""

from __future__ import annotations

import pytest

from specdraft.data.formats import Conversation, Message, Text, detect_format, parse_record
from specdraft.data.sources import SkipRow

EXPECTED = Conversation(
    (
        Message("system", "Be brief."),
        Message("user", "Hi"),
        Message("assistant", "Hello!"),
        Message("user", "Bye"),
        Message("assistant", "Bye!"),
    )
)


def test_sharegpt_messages_and_ultrachat_read_the_same():
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "user", "value": "Bye"},
            {"from": "assistant", "value": "Bye!"},
        ]
    }
    messages = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye!"},
        ]
    }
    ultrachat = {"data": ["Hi", "Hello!", "Bye", "Bye!"]}
    assert parse_record(sharegpt) == EXPECTED
    assert parse_record(sharegpt, "sharegpt") == EXPECTED
    assert parse_record(messages, "messages") == EXPECTED
    assert parse_record(ultrachat, "ultrachat") == Conversation(EXPECTED.messages[1:])


def test_top_level_system_field_becomes_the_system_prompt():
    row = {
        "system": "Be brief.",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}],
    }
    assert parse_record(row).messages[0] == Message("system", "Be brief.")


def test_ultrachat_200k_rows_read_as_messages():
    row = {
        "prompt": "Hi",
        "prompt_id": "x",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
    }
    assert detect_format(row) == "messages"
    with pytest.raises(SkipRow, match="use format messages or auto"):
        parse_record(row, "ultrachat")


def test_text_rows():
    assert parse_record("some text") == Text("some text")
    assert parse_record({"text": "doc", "meta": 1}) == Text("doc")
    assert parse_record({"text": "doc"}, "text") == Text("doc")


def test_trailing_user_turn_is_dropped():
    row = {"data": ["Hi", "Hello!", "unanswered"]}
    assert parse_record(row).messages[-1] == Message("assistant", "Hello!")


@pytest.mark.parametrize(
    ("row", "reason", "in_detail"),
    [
        ({"conversations": []}, "empty_conversation", "empty"),
        ({"messages": None}, "empty_conversation", "empty"),
        (
            {
                "messages": [
                    {"role": "tool", "content": "42"},
                    {"role": "assistant", "content": "ok"},
                ]
            },
            "unknown_role",
            "'tool'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": None},
                ]
            },
            "non_string_content",
            "NoneType",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    {"role": "assistant", "content": "ok"},
                ]
            },
            "non_string_content",
            "list",
        ),
        ({"data": ["Hi", 3]}, "non_string_content", "item 1"),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}]},
            "no_assistant_turn",
            "no assistant",
        ),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, "assistant_first", "starts with"),
        ({"messages": ["Hi"]}, "malformed_message", "message 0"),
        ({"messages": [{"content": "Hi"}]}, "malformed_message", "'role'"),
        ({"text": 5}, "non_string_content", "int"),
        ({"text": "  \n"}, "empty_text", "empty"),
        ({"prompt": "x", "response": "y"}, "unknown_format", "'prompt'"),
        (7, "unknown_format", "int"),
    ],
)
def test_bad_rows_are_skipped_with_a_reason(row, reason, in_detail):
    with pytest.raises(SkipRow) as info:
        parse_record(row)
    assert info.value.reason == reason
    assert in_detail in info.value.detail


def test_forced_format_names_the_missing_field():
    with pytest.raises(SkipRow) as info:
        parse_record({"messages": []}, "sharegpt")
    assert info.value.reason == "missing_field"
    assert "'conversations'" in info.value.detail and "messages" in info.value.detail
