"""Tiny tokenizers built in memory, each with a chat template written here, so the loss-mask
goldens know exactly what the template renders. (A module of its own rather than conftest.py,
whose name other test folders share: tests import its constants by name.)"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# ChatML (Qwen and many others). Written with Jinja string literals because the template engine
# drops a newline that follows a block tag.
CHATML_TEMPLATE = (
    r"{% for m in messages %}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The same rendering, with `{% generation %}` around what the assistant writes, so that
# transformers' own `return_assistant_tokens_mask` can be compared with ours.
CHATML_GENERATION_TEMPLATE = (
    r"{% for m in messages %}"
    r"{% if m['role'] == 'assistant' %}"
    r"{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    r"{% else %}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 3: BOS written by the template, headers, content trimmed, <|eot_id|> closes each turn.
LLAMA3_TEMPLATE = (
    r"{{ bos_token }}"
    r"{% for m in messages %}"
    r"{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Every word and every single other character (space, newline, punctuation) is one token, so the
# ids of a rendered conversation can be read off this list: id = position.
WORD_VOCAB = [
    "[UNK]",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "\n",
    " ",
    ".",
    "!",
    "?",
    ",",
    "system",
    "user",
    "assistant",
    "Be",
    "brief",
    "Hi",
    "Hello",
    "What",
    "is",
    "two",
    "plus",
    "Four",
    "And",
    "times",
    "three",
    "Six",
    "the",
    "cat",
    "sat",
    "on",
    "mat",
]


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(WORD_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens carry their own spaces: decoding concatenates
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (the Llama 3 / GPT-2 kind) trained on a few sentences. Its post-processor
    adds BOS, as Llama 3's does, to check that the pipeline does not add a second one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sentences = [
        "You are a helpful assistant.",
        "What is the capital of France? The capital of France is Paris.",
        "And of Italy? Rome is the capital of Italy.",
        "system user assistant",
    ]
    tok.train_from_iterator(sentences * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
    )
    hf.chat_template = LLAMA3_TEMPLATE
    return hf
