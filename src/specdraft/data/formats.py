"""Row formats in, one shape out: every row becomes a `Conversation` (system/user/assistant
messages) or a `Text` (a plain document), and every example a trainer sees is an `Example`.

Formats read (`DataConfig.format`; `auto` detects per row, so one file may mix them):
  sharegpt   {"conversations": [{"from": "human", "value": "..."}, ...]}
  messages   {"messages": [{"role": "user", "content": "..."}, ...]}   (OpenAI / HF chat)
  ultrachat  {"data": ["user text", "assistant text", ...]}              (raw UltraChat; note HF
             ultrachat_200k rows carry `messages` and read as `messages`)
  text       {"text": "..."}, a bare JSON string, or a whole text file
A ShareGPT or messages row may also carry a top-level "system" string, used as the system prompt
when the conversation has none.

A row that cannot be used raises `SkipRow` with a reason the summary counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdraft.data.sources import SkipRow

# Roles as datasets spell them -> the three roles every chat template knows. Other roles (tool,
# function, observation) are skipped rather than guessed at: templates disagree on them.
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]  # ends with an assistant message; at least one assistant turn


@dataclass(frozen=True)
class Text:
    text: str  # a non-empty document, packed with others into fixed-length blocks


@dataclass
class Example:
    """One training sample, as trainers consume it.

    input_ids[t] is the t-th token; loss_mask[t] == 1 means token t is a training target (the
    model is trained to predict it from the tokens before it). Same length, at most max_length.

    A packed row (data.pack) holds several documents end to end: `document_lengths` are their
    lengths in order, and each attends only to itself, its positions starting at 0 (a token is
    predicted only from the tokens before it in its own document). None: the row is one
    document. `document_indices` are the documents' indices among the conversations packed
    (`pack_documents`' input): a kind that draws per sample seeds each document's draws with
    its index, as it seeds an unpacked row's with the row's.
    """

    input_ids: list[int]
    loss_mask: list[int]
    source: str = ""  # where it came from: a row's location, or "packed text block 7"
    truncated: bool = False  # cut to max_length (overlong: truncate)
    document_lengths: list[int] | None = None
    document_indices: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"input_ids ({len(self.input_ids)}) and loss_mask ({len(self.loss_mask)}) differ in length"
            )
        if self.document_lengths is not None and (
            sum(self.document_lengths) != len(self.input_ids) or min(self.document_lengths) < 1
        ):
            raise ValueError(
                f"document_lengths {self.document_lengths} do not split the row's "
                f"{len(self.input_ids)} tokens into non-empty documents"
            )
        if self.document_indices is not None and (
            self.document_lengths is None
            or len(self.document_indices) != len(self.document_lengths)
        ):
            raise ValueError(
                f"document_indices {self.document_indices} do not name the row's documents "
                f"(document_lengths {self.document_lengths}) one to one"
            )


def parse_record(record: Any, fmt: str = "auto") -> Conversation | Text:
    """The conversation or document in one row, read as `fmt` ("auto": detected from its fields)."""
    if fmt == "auto":
        fmt = detect_format(record)
    if fmt == "text":
        return _parse_text(record)
    if not isinstance(record, dict):
        raise SkipRow(
            "unknown_format", f"format '{fmt}' needs a JSON object, got {type(record).__name__}"
        )
    field_name = {"sharegpt": "conversations", "messages": "messages", "ultrachat": "data"}[fmt]
    if field_name not in record:
        hint = (
            " (HF ultrachat_200k rows carry 'messages': use format messages or auto)"
            if fmt == "ultrachat"
            else ""
        )
        raise SkipRow(
            "missing_field",
            f"format '{fmt}' needs a '{field_name}' list; this row has fields {sorted(record)}{hint}",
        )
    turns = record[field_name]
    if turns is None or (isinstance(turns, list) and not turns):
        raise SkipRow("empty_conversation", f"'{field_name}' is empty")
    if not isinstance(turns, list):
        raise SkipRow(
            "malformed_message", f"'{field_name}' must be a list, got {type(turns).__name__}"
        )
    if fmt == "ultrachat":
        messages = _ultrachat_messages(turns)
    else:
        messages = [_message(turn, i) for i, turn in enumerate(turns)]
        system = record.get("system")
        if isinstance(system, str) and system.strip() and messages[0].role != "system":
            messages.insert(0, Message("system", system))
    return _conversation(messages)


def detect_format(record: Any) -> str:
    if isinstance(record, str):
        return "text"
    if isinstance(record, dict):
        # Checked in this order because some datasets carry several (ultrachat_200k has both
        # `prompt` and `messages`); the structured conversation wins over a flat text field.
        for key, fmt in (
            ("messages", "messages"),
            ("conversations", "sharegpt"),
            ("data", "ultrachat"),
            ("text", "text"),
        ):
            if key in record:
                return fmt
        raise SkipRow(
            "unknown_format",
            f"no 'messages', 'conversations', 'data' or 'text' field (fields: {sorted(record)})",
        )
    raise SkipRow(
        "unknown_format", f"a row must be a JSON object or string, got {type(record).__name__}"
    )


def _parse_text(record: Any) -> Text:
    text = record.get("text") if isinstance(record, dict) else record
    if isinstance(record, dict) and "text" not in record:
        raise SkipRow(
            "missing_field", f"format 'text' needs a 'text' field; this row has {sorted(record)}"
        )
    if not isinstance(text, str):
        raise SkipRow("non_string_content", f"'text' must be a string, got {type(text).__name__}")
    if not text.strip():
        raise SkipRow("empty_text", "the text is empty")
    return Text(text)


def _message(turn: Any, index: int) -> Message:
    # ShareGPT spells a message {from, value}, OpenAI {role, content}; either is accepted in
    # either format, since datasets mix them up.
    if not isinstance(turn, dict):
        raise SkipRow(
            "malformed_message", f"message {index} is a {type(turn).__name__}, not an object"
        )
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if not isinstance(role, str):
        raise SkipRow("malformed_message", f"message {index} has no 'role' (or 'from') string")
    if role.strip().lower() not in ROLES:
        raise SkipRow(
            "unknown_role",
            f"message {index} has role {role!r}; known roles: {', '.join(sorted(ROLES))}",
        )
    if not isinstance(content, str):
        raise SkipRow(
            "non_string_content",
            f"message {index} ({role}) has content of type {type(content).__name__}, not a string",
        )
    return Message(ROLES[role.strip().lower()], content)


def _ultrachat_messages(turns: list[Any]) -> list[Message]:
    messages = []
    for index, content in enumerate(turns):
        if not isinstance(content, str):
            raise SkipRow(
                "non_string_content",
                f"'data' item {index} is a {type(content).__name__}, not a string",
            )
        messages.append(Message("user" if index % 2 == 0 else "assistant", content))
    return messages


def _conversation(messages: list[Message]) -> Conversation:
    # Trailing user or system turns hold no assistant token to learn: drop them, keep the rest.
    while messages and messages[-1].role != "assistant":
        messages.pop()
    if not messages:
        raise SkipRow("no_assistant_turn", "the conversation has no assistant message")
    if messages[0].role == "assistant":
        # Rendering "the conversation before this turn" would be empty, which chat templates
        # cannot render; an opening assistant turn also answers nothing.
        raise SkipRow("assistant_first", "the conversation starts with an assistant message")
    return Conversation(tuple(messages))
