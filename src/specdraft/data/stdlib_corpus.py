"""The demo corpus and tokenizer: the standard library's own Python source.

Every Python installation carries its standard library, so the demo target
(docs/architecture.md, "The embedded default") can be trained and evaluated with no network.
Files are split into train and held-out by a hash of their path relative to the stdlib root, so
the split is the same on every machine with the same Python version and never depends on file
order or a random seed.
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import cache
from pathlib import Path

from transformers import PreTrainedTokenizerFast

# Folders left out of the corpus: tests (huge, repetitive, and partly invalid source on purpose),
# generated tables (codecs, pydoc topics) and third-party packages.
_EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings"}
_EXCLUDED_FILES = {"pydoc_data/topics.py", "unicodedata.py"}
# One file in this many (by path hash) is held out of training for evaluation prompts.
_HELDOUT_MODULUS = 25

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]

# `<|bos|>` once, then `<|role|>\n{content}<|end|>\n` per message; the generation prompt opens an
# assistant turn. A turn ends with `<|end|>`, which is therefore also a stop token.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('demo chat template: unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder (the base one, also inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


@cache
def _corpus_files() -> tuple[tuple[str, bool], ...]:
    """(relative path, held out?) for every corpus file, sorted by path."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if set(Path(rel).parts[:-1]) & _EXCLUDED_PARTS or rel in _EXCLUDED_FILES:
            continue
        digest = hashlib.sha1(rel.encode()).digest()
        files.append((rel, int.from_bytes(digest[:4], "big") % _HELDOUT_MODULUS == 0))
    if not files:
        raise FileNotFoundError(
            f"no Python source found under the standard library folder {root}; the demo corpus "
            "needs an interpreter that ships its stdlib as .py files"
        )
    return tuple(files)


def demo_corpus_files(split: str = "train") -> list[Path]:
    """The corpus files of one split: "train" or "heldout"."""
    if split not in ("train", "heldout"):
        raise ValueError(f"demo corpus split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root()
    return [root / rel for rel, held in _corpus_files() if held == (split == "heldout")]


def demo_corpus_texts(split: str = "train") -> list[str]:
    """The text of every corpus file of one split, in path order."""
    texts = []
    for path in demo_corpus_files(split):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            texts.append(text + "\n")
    return texts


def demo_prompts(n: int, lines: int = 12) -> list[str]:
    """n evaluation prompts cut from the held-out files: each is `lines` lines of source ending
    with a `def` line (and its docstring opener, if any), so a good model has an obvious
    continuation. Deterministic; taken round-robin over files so no one file dominates."""
    if n < 1:
        raise ValueError(f"demo_prompts needs n >= 1, got {n}")
    per_file = []
    for text in demo_corpus_texts("heldout"):
        src = text.splitlines(keepends=True)
        per_file.append([
            "".join(src[max(0, i + 1 - lines) : i + 1])
            for i, line in enumerate(src)
            if _opens_function(line) and i >= lines // 2
        ])  # fmt: skip
    prompts = round_robin(per_file, n)
    if len(prompts) < n:
        raise ValueError(
            f"the held-out demo files yield only {len(prompts)} prompts; ask for fewer"
        )
    return prompts


def demo_conversations(n: int, split: str = "train", max_lines: int = 40) -> list[dict]:
    """n chat rows ({"messages": [...]}) cut from the corpus files of `split`: a user asks for a
    function by its signature line, and the assistant answers with the function's source (up to
    `max_lines` lines). Their lengths are as ragged as the library's functions, which is what
    packing conversations is measured on (benchmarks/bench_packing.py). Deterministic; taken
    round-robin over files, like `demo_prompts`."""
    if n < 1:
        raise ValueError(f"demo_conversations needs n >= 1, got {n}")
    per_file = []
    for text in demo_corpus_texts(split):
        src = text.splitlines()
        rows = []
        for i, line in enumerate(src):
            if not _opens_function(line):
                continue
            stripped = line.lstrip()
            indent = len(line) - len(stripped)
            end = i + 1
            while (
                end < len(src)
                and end - i < max_lines
                and (not src[end].strip() or len(src[end]) - len(src[end].lstrip()) > indent)
            ):
                end += 1
            body = "\n".join(s[indent:] for s in src[i:end]).rstrip()
            ask = f"Write this Python function:\n{stripped.rstrip()}"
            rows.append({"messages": [
                {"role": "user", "content": ask}, {"role": "assistant", "content": body},
            ]})  # fmt: skip
        per_file.append(rows)
    out = round_robin(per_file, n)
    if len(out) < n:
        raise ValueError(f"the {split} demo files yield only {len(out)} conversations")
    return out


def _opens_function(line: str) -> bool:
    """A `def` line ending its signature (`def f(x):`, at any indent)."""
    return line.lstrip().startswith("def ") and line.rstrip().endswith(":")


def round_robin(per_file: list[list], n: int | None = None) -> list:
    """The first n (None: all) items taken round-robin over files (every file's first, then
    every file's second, ...), so no one file dominates."""
    rounds = max(map(len, per_file), default=0)
    items = [file[depth] for depth in range(rounds) for file in per_file if depth < len(file)]
    return items if n is None else items[:n]


def build_demo_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train the demo's byte-level BPE on `texts` and wrap it as a HF fast tokenizer with the
    demo chat template. Deterministic for the same texts and vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        chat_template=DEMO_CHAT_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
