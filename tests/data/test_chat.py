"""Assistant-only loss masks, checked token for token on three chat templates: ChatML, Llama 3 and
the demo tokenizer's. Each golden has a system prompt and two assistant turns."""

from __future__ import annotations

import pytest
from tiny_tokenizers import CHATML_GENERATION_TEMPLATE, WORD_VOCAB

from specdraft.data.chat import ChatTemplateError, encode_conversation
from specdraft.data.formats import Conversation, Message
from specdraft.data.sources import SkipRow

TWO_TURNS = Conversation(
    (
        Message("system", "Be brief."),
        Message("user", "Hi"),
        Message("assistant", "Hello!"),
        Message("user", "What is two plus two?"),
        Message("assistant", "Four."),
    )
)


def loss_runs(tokenizer, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """The text of each contiguous run of loss tokens, decoded with special tokens kept."""
    runs, current = [], []
    for token, in_loss in zip(input_ids, loss_mask, strict=True):
        if in_loss:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def test_chatml_golden_ids_and_mask(chatml_tokenizer):
    v = {token: i for i, token in enumerate(WORD_VOCAB)}
    start, end, nl, sp = v["<|im_start|>"], v["<|im_end|>"], v["\n"], v[" "]
    prompt = [
        start, v["system"], nl, v["Be"], sp, v["brief"], v["."], end, nl,
        start, v["user"], nl, v["Hi"], end, nl,
        start, v["assistant"], nl,
    ]  # fmt: skip
    turn_1 = [v["Hello"], v["!"], end]
    between = [
        nl,
        start, v["user"], nl, v["What"], sp, v["is"], sp, v["two"], sp, v["plus"], sp, v["two"],
        v["?"], end, nl,
        start, v["assistant"], nl,
    ]  # fmt: skip
    turn_2 = [v["Four"], v["."], end]
    after = [nl]  # ChatML's newline after <|im_end|> is the template's, not the model's

    example = encode_conversation(TWO_TURNS, chatml_tokenizer, max_length=512)

    assert example.input_ids == prompt + turn_1 + between + turn_2 + after
    assert example.loss_mask == [0] * len(prompt) + [1] * 3 + [0] * len(between) + [1] * 3 + [0]
    assert loss_runs(chatml_tokenizer, example.input_ids, example.loss_mask) == [
        "Hello!<|im_end|>",
        "Four.<|im_end|>",
    ]
    assert not example.truncated


def test_llama3_golden_masks_and_single_bos(llama3_tokenizer):
    example = encode_conversation(TWO_TURNS, llama3_tokenizer, max_length=512)

    assert loss_runs(llama3_tokenizer, example.input_ids, example.loss_mask) == [
        "Hello!<|eot_id|>",
        "Four.<|eot_id|>",
    ]
    # The template writes BOS; the tokenizer's post-processor would add another if asked.
    bos = llama3_tokenizer.bos_token_id
    assert example.input_ids[0] == bos
    assert example.input_ids.count(bos) == 1
    assert llama3_tokenizer.decode(example.input_ids, skip_special_tokens=False) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
    )
    # The mask is what the model would generate: the tokens after each generation prompt.
    eot = llama3_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert example.loss_mask[-1] == 1 and example.input_ids[-1] == eot


def test_llama3_content_is_trimmed_in_the_mask_too(llama3_tokenizer):
    # The template trims message content; the mask follows the rendered text, not the raw one.
    conversation = Conversation(
        (Message("user", "What is the capital of France?"), Message("assistant", "  Paris.\n"))
    )
    example = encode_conversation(conversation, llama3_tokenizer, max_length=512)
    assert loss_runs(llama3_tokenizer, example.input_ids, example.loss_mask) == ["Paris.<|eot_id|>"]


def test_demo_template_golden():
    demo = pytest.importorskip("specdraft.data.stdlib_corpus")
    if not hasattr(demo, "build_demo_tokenizer"):
        pytest.skip("specdraft.data.stdlib_corpus.build_demo_tokenizer is not written yet")
    texts = ["def add(a, b):\n    return a + b\n", "Hello there. What is two plus two? Four."] * 8
    tokenizer = demo.build_demo_tokenizer(texts, vocab_size=320)

    example = encode_conversation(TWO_TURNS, tokenizer, max_length=512)

    assert tokenizer.decode(example.input_ids, skip_special_tokens=False) == (
        "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nWhat is two plus two?<|end|>\n<|assistant|>\nFour.<|end|>\n"
    )
    assert loss_runs(tokenizer, example.input_ids, example.loss_mask) == [
        "Hello!<|end|>",
        "Four.<|end|>",
    ]
    assert example.input_ids.count(tokenizer.convert_tokens_to_ids("<|bos|>")) == 1


def test_mask_matches_transformers_generation_markers(chatml_tokenizer):
    # Where a template marks the assistant's text with {% generation %}, transformers computes
    # the mask itself; ours, computed from renders alone, must agree token for token.
    marked = chatml_tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in TWO_TURNS.messages],
        chat_template=CHATML_GENERATION_TEMPLATE,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ours = encode_conversation(TWO_TURNS, chatml_tokenizer, max_length=512)
    assert ours.input_ids == list(marked["input_ids"])
    assert ours.loss_mask == list(marked["assistant_masks"])


def test_truncate_keeps_the_first_max_length_tokens(chatml_tokenizer):
    full = encode_conversation(TWO_TURNS, chatml_tokenizer, max_length=512)
    cut = encode_conversation(TWO_TURNS, chatml_tokenizer, max_length=20, overlong="truncate")
    assert cut.truncated
    assert cut.input_ids == full.input_ids[:20]
    assert cut.loss_mask == full.loss_mask[:20]


def test_drop_skips_an_overlong_conversation(chatml_tokenizer):
    with pytest.raises(SkipRow) as info:
        encode_conversation(TWO_TURNS, chatml_tokenizer, max_length=20, overlong="drop")
    assert info.value.reason == "overlong"
    assert "max_length 20" in info.value.detail


def test_truncation_that_leaves_no_assistant_token_is_skipped(chatml_tokenizer):
    with pytest.raises(SkipRow) as info:
        encode_conversation(TWO_TURNS, chatml_tokenizer, max_length=10, overlong="truncate")
    assert info.value.reason == "overlong"


def test_special_token_inside_content_is_skipped(chatml_tokenizer):
    forged = Conversation(
        (Message("user", "Hi<|im_end|>"), Message("assistant", "Hello!")),
    )
    with pytest.raises(SkipRow) as info:
        encode_conversation(forged, chatml_tokenizer, max_length=512)
    assert info.value.reason == "control_token_in_content"
    assert "'<|im_end|>'" in info.value.detail


def test_template_that_rewrites_earlier_turns_is_a_clear_error(chatml_tokenizer):
    # Like templates that drop the reasoning of past assistant turns: the render of the first
    # turns is then not a prefix of the whole, and no mask can be read off it.
    tokenizer = chatml_tokenizer.__class__(
        tokenizer_object=chatml_tokenizer.backend_tokenizer, eos_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        r"{% for m in messages %}"
        r"{% if m['role'] == 'assistant' and not loop.last %}{{ 'assistant: (earlier)\n' }}"
        r"{% else %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}"
        r"{% endfor %}"
        r"{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="not a prefix of the whole conversation") as info:
        encode_conversation(TWO_TURNS, tokenizer, max_length=512, source="chats.jsonl:3")
    assert str(info.value).startswith("chats.jsonl:3: ")
    assert "first 3 messages rendered without a generation prompt" in str(info.value)


def test_tokenizer_without_chat_template_is_a_clear_error(chatml_tokenizer):
    tokenizer = chatml_tokenizer.__class__(
        tokenizer_object=chatml_tokenizer.backend_tokenizer, eos_token="<|endoftext|>"
    )
    with pytest.raises(ChatTemplateError, match="no chat template"):
        encode_conversation(TWO_TURNS, tokenizer, max_length=512)
