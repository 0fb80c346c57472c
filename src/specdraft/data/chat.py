"""Conversations -> token ids with an assistant-only loss mask, through the target's chat template.

The mask comes from the rendered text, not from template markers, so it works with any template
(most have no `{% generation %}` blocks):

1. Render the whole conversation once (`apply_chat_template(..., tokenize=False)`).
2. For assistant turn i, its characters are [len(render(messages[:i], add_generation_prompt=True)),
   len(render(messages[:i+1]))): what the model writes after the template has prompted it,
   up to and including the turn's end-of-turn token (the model must learn to stop). Whitespace the
   template writes after that end token is not the model's to generate, so it is left out.
   Each partial render must be a prefix of the full render; a template that rewrites earlier
   turns when a later one is added breaks this, and is reported as `ChatTemplateError`.
3. Tokenize the full text once with `add_special_tokens=False` (the template writes BOS itself
   where the model wants one, exactly as `apply_chat_template(tokenize=True)` does at inference)
   and character offsets; a token is in the loss iff its first character lies in an assistant
   span.
"""

from __future__ import annotations

import re

import jinja2

from specdraft.data.formats import Conversation, Example
from specdraft.data.sources import DataError, SkipRow


class ChatTemplateError(DataError):
    """The tokenizer's chat template cannot give an assistant-only loss mask. This is about the
    template, not one row, so it stops the run with a message saying what to change."""


def encode_conversation(
    conversation: Conversation,
    tokenizer,
    max_length: int,
    overlong: str = "truncate",
    source: str = "",
) -> Example:
    """Token ids and loss mask of one conversation, at most `max_length` tokens.

    An over-long conversation is cut to `max_length` (overlong="truncate") or skipped
    (overlong="drop"); one whose cut leaves no assistant token is skipped either way.
    Raises `SkipRow` for an unusable row and `ChatTemplateError` for an unusable template.
    """
    _check_no_control_tokens(conversation, tokenizer)
    text, spans = assistant_spans(conversation, tokenizer, source)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    loss_mask = loss_mask_from_spans(encoding["offset_mapping"], spans)

    truncated = len(input_ids) > max_length
    if truncated:
        if overlong == "drop":
            raise SkipRow(
                "overlong",
                f"{len(input_ids)} tokens > max_length {max_length} (overlong: drop; raise "
                "max_length or set overlong: truncate to keep it)",
            )
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if not any(loss_mask):
        raise SkipRow(
            "overlong" if truncated else "no_assistant_tokens",
            f"no assistant token within the first {max_length} tokens (raise max_length)"
            if truncated
            else "the assistant turns render to no tokens",
        )
    return Example(input_ids, loss_mask, source, truncated)


def assistant_spans(
    conversation: Conversation, tokenizer, source: str = ""
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the tokenizer {type(tokenizer).__name__} has no chat template, so conversations "
            "cannot be rendered. Use the target's own tokenizer (instruct models ship one), set "
            "tokenizer.chat_template, or train on plain text (format: text)."
        )
    messages = [{"role": m.role, "content": m.content} for m in conversation.messages]
    full = _render(tokenizer, messages, add_generation_prompt=False)
    end_tokens = _special_tokens(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1])
        for count, how, part in (
            (i, "with add_generation_prompt=True", prompt),
            (i + 1, "without a generation prompt", through),
        ):
            if not full.startswith(part):
                raise ChatTemplateError(_not_a_prefix(tokenizer, count, how, part, full, source))
        start, end = len(prompt), len(through)
        if end <= start:
            # Some templates write nothing for an empty message: nothing to learn in this turn.
            raise SkipRow(
                "no_assistant_tokens", f"the chat template renders assistant turn {i} as nothing"
            )
        spans.append((start, _end_of_turn(full, start, end, end_tokens)))
    return full, spans


def loss_mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in one of `spans` (sorted, disjoint)."""
    mask, span = [], 0
    for token_start, _ in offsets:
        # Offsets and spans both run left to right, so one pass over each suffices.
        while span < len(spans) and token_start >= spans[span][1]:
            span += 1
        mask.append(int(span < len(spans) and spans[span][0] <= token_start))
    return mask


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as e:
        # Templates reject some conversations on purpose (roles out of order, a system prompt
        # they do not support); that is the row's problem, not the run's.
        raise SkipRow(
            "template_rejected", f"the chat template refused this conversation: {e}"
        ) from e


def _end_of_turn(full: str, start: int, end: int, end_tokens: tuple[str, ...]) -> int:
    """`end`, less the whitespace after the turn's end-of-turn token (ChatML's "\\n" after
    <|im_end|>): the model stops at the token and never writes that separator."""
    stripped = start + len(full[start:end].rstrip())
    if any(full.endswith(token, start, stripped) for token in end_tokens):
        return stripped
    return end


def _special_tokens(tokenizer) -> tuple[str, ...]:
    special = set(tokenizer.all_special_tokens)
    special.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return tuple(sorted(special, key=lambda token: (-len(token), token)))  # longest first


def _check_no_control_tokens(conversation: Conversation, tokenizer) -> None:
    # Message text holding a special token (a literal "<|im_end|>") would be encoded as that
    # control token, ending a turn or faking one; such rows are skipped rather than trained on.
    # One alternation for all tokens: Llama 3 has 256 of them. (`re` caches the compiled pattern.)
    pattern = "|".join(re.escape(token) for token in _special_tokens(tokenizer))
    for i, message in enumerate(conversation.messages):
        found = re.search(pattern, message.content) if pattern else None
        if found:
            raise SkipRow(
                "control_token_in_content",
                f"message {i} ({message.role}) contains the special token {found.group()!r} as text",
            )


def _not_a_prefix(tokenizer, count: int, how: str, part: str, full: str, source: str) -> str:
    at = next((k for k, (a, b) in enumerate(zip(part, full, strict=False)) if a != b), len(part))
    return (
        f"{source + ': ' if source else ''}the chat template of {type(tokenizer).__name__} does not render conversations "
        f"incrementally: the first {count} messages rendered {how} are not a prefix of the whole "
        f"conversation (they differ at character {at}: {part[at : at + 40]!r} vs "
        f"{full[at : at + 40]!r}). Assistant-only loss masks need each partial render to be a "
        "prefix of the full one; templates that rewrite earlier turns (e.g. drop the reasoning "
        "of past assistant turns) do not. Set tokenizer.chat_template to a template without "
        "that rewriting, or train on single-turn conversations."
    )
