"""Regenerate the assistant turns of a conversation dataset with the target, so drafters train on
what the target actually says (the distribution they will be verified against).

    python scripts/regenerate.py --data chats.jsonl --output chats.regen.jsonl --target demo
    python scripts/regenerate.py ... --temperature 0.7 --top-p 0.9 --seed 1   # sampled
    python scripts/regenerate.py --data stdlib-requests --limit 2000 --target smollm2-135m \
        --output data/stdlib-requests.smollm2.jsonl --batch-size 16

Each conversation is replayed turn by turn: the target answers every user turn given the history
so far, its earlier answers included (so a multi-turn row stays coherent). System and user turns
are kept; a conversation that ends with a user turn gets that turn answered (a file of prompts
alone); rows that are not conversations, or cannot be parsed, are counted and skipped.
`--data stdlib-requests` is a chat dataset that is on every machine: requests built from the
Python standard library's documented functions (data/requests.py), for training a drafter of a
chat target offline.

Conversations are answered `--batch-size` at a time, in one batched decode of the project's own
loop per turn (plain decoding by default, or `--drafter prompt_lookup|FOLDER`): greedy in fp32,
each row is exactly what it would be alone (in bf16 a batched pass can round a near tie
otherwise). Progress (conversations, tokens, tokens/s) goes to stderr.

Plain text (a text file, `{"text": ...}` rows, or `--data demo` for the demo corpus's training
files) is continued instead when `--prompt-tokens N` is given: the target writes the rest after
the row's first N tokens (with `--stride S`, after every S tokens through the row, one output row
each), so a drafter trained on the result sees what the target writes rather than what a human
wrote; BENCHMARKS.md ("EAGLE") measures what that buys. Continuations are drafted by prompt
lookup in our own loop, which keeps them exactly the target's.

Output is JSON lines, one per conversation, `{"messages": [...], "source": "<row location>"}`
(or one per continuation, `{"text": ..., "source": "<row location>@<token offset>"}`), readable
by the data pipeline (`data.format: messages` or `text`). The run is resumable: rerunning the same
command skips conversations already in the output (matched by `source`), and a last line cut off
by a crash is dropped first. Sampling is seeded per conversation, so a resumed run writes what an
uninterrupted one would have; greedy in fp32, that holds whatever the batch size (sampled, a batch draws
from one generator seeded by its first row, so a resumed run's batches are other draws from the
same distribution).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from specdraft.data.formats import Conversation, Text, parse_record
from specdraft.data.requests import stdlib_requests
from specdraft.data.sources import DataError, Row, SkipRow, read_rows
from specdraft.data.stdlib_corpus import demo_corpus_texts
from specdraft.formats import load_drafter
from specdraft.inference import generate
from specdraft.measuring.measure import choose_threads
from specdraft.targets.target import TARGET_HELP, load_target
from specdraft.tools.arguments import add_threads_argument


def regenerate(
    target,
    data: str,
    output: str | Path,
    *,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    limit: int | None = None,
    fmt: str = "auto",
    prompt_tokens: int = 0,
    stride: int = 0,
    name: str | None = None,
    split: str = "train",
    batch_size: int = 1,
    drafter=None,
    log=print,
) -> Counter:
    """Append regenerated conversations of `data` to `output` (and continuations of its plain
    text when `prompt_tokens` > 0, see the module docstring); returns counts of what happened,
    `generated_tokens` and `seconds` among them. `name` and `split`: the configuration and split
    of a hub dataset (UltraChat's is train_sft). Conversations are answered `batch_size` at a
    time, drafted by `drafter` (None: plain decoding; "prompt_lookup"; a loaded drafter)."""
    if prompt_tokens < 0 or stride < 0:
        raise DataError(f"--prompt-tokens and --stride must be >= 0; got {prompt_tokens}, {stride}")
    if batch_size < 1:
        raise DataError(f"--batch-size must be >= 1; got {batch_size}")
    output = Path(output)
    done = _done_sources(output)
    counts: Counter = Counter(already_done=len(done))
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    batch: list[tuple[int, str, Conversation]] = []

    def answer(out) -> None:
        replies = _replay_batch(target, [c for _, _, c in batch], drafter, max_new_tokens,
                                temperature, top_p, seed + batch[0][0])  # fmt: skip
        for (_, where, _), (messages, tokens) in zip(batch, replies, strict=True):
            _write(out, {"messages": messages, "source": where}, tokens, counts)
        batch.clear()
        seconds = time.perf_counter() - start
        log(f"[specdraft] regenerate: {counts['written']} written, {counts['generated_tokens']:,}"
            f" tokens, {counts['generated_tokens'] / seconds:.1f} tokens/s")  # fmt: skip

    with output.open("a", encoding="utf-8") as out:
        for index, row in enumerate(_rows(data, name, split)):
            if limit is not None and counts["written"] + len(batch) >= limit:
                break
            if row.where in done:
                continue
            if row.error is not None:
                counts[f"skipped: {row.error.reason}"] += 1
                continue
            try:
                item = parse_record(_answer_slot(row.record), fmt)
            except SkipRow as e:
                counts[f"skipped: {e.reason}"] += 1
                continue
            if isinstance(item, Text) and prompt_tokens > 0:
                ends = _prompt_ends(target, item.text, prompt_tokens, stride)
                if not ends:
                    counts["skipped: not longer than --prompt-tokens"] += 1
                for n, (end, prompt) in enumerate(ends):
                    source = f"{row.where}@{end}"
                    if source in done:
                        continue
                    if limit is not None and counts["written"] >= limit:
                        break
                    text, tokens = _continue(target, prompt, max_new_tokens, temperature, top_p,
                                             (seed + index) * 100_003 + n)  # fmt: skip
                    _write(out, {"text": text, "source": source}, tokens, counts)
                continue
            if not isinstance(item, Conversation):
                plain = isinstance(item, Text)
                reason = "plain text (see --prompt-tokens)" if plain else "not a conversation"
                counts[f"skipped: {reason}"] += 1
                continue
            batch.append((index, row.where, item))
            if len(batch) == batch_size:
                answer(out)
        if batch:
            answer(out)
    counts["seconds"] = round(time.perf_counter() - start)
    return counts


def _answer_slot(record):
    """A conversation row that ends with a user turn, with an empty assistant turn after it for
    the target to answer (a file of prompts alone); any other row as it is."""
    if not isinstance(record, dict):
        return record
    for key in ("messages", "conversations"):
        turns = record.get(key)
        if isinstance(turns, list) and turns and isinstance(turns[-1], dict):
            role = str(turns[-1].get("role", turns[-1].get("from", ""))).strip().lower()
            if role in ("user", "human"):
                return {**record, key: [*turns, {"role": "assistant", "content": ""}]}
    return record


def _write(out, record: dict, tokens: int, counts: Counter) -> None:
    """`record` as a line of `out`, on disk when this returns, counted with its `tokens`."""
    out.write(json.dumps(record) + "\n")
    out.flush()
    os.fsync(out.fileno())  # a line is either fully on disk or dropped on resume
    counts["written"] += 1
    counts["generated_tokens"] += tokens


def _rows(data: str, name: str | None = None, split: str = "train"):
    """read_rows(data, name, split), or the demo corpus's training files for "demo" (one row
    per file)."""
    if data == "stdlib-requests":
        for row in stdlib_requests(None, split="heldout" if split == "heldout" else "train"):
            yield Row(where=row["source"], record=row)
        return
    if data != "demo":
        yield from read_rows(data, name, split)
        return
    for i, text in enumerate(demo_corpus_texts("train")):
        yield Row(where=f"demo[{i}]", record=text)


def _prompt_ends(target, text: str, prompt_tokens: int, stride: int) -> list[tuple[int, list]]:
    """(token offset, the prompt_tokens ids before it) for each continuation of `text`: after its
    first prompt_tokens tokens, and after every `stride` tokens further on when stride > 0."""
    ids = target.tokenizer(text, add_special_tokens=False).input_ids
    ends = range(prompt_tokens, len(ids), stride) if stride > 0 else [prompt_tokens]
    return [(end, ids[end - prompt_tokens : end]) for end in ends if end < len(ids)]


def _continue(
    target, prompt: list[int], max_new_tokens, temperature, top_p, seed
) -> tuple[str, int]:
    """The prompt's text followed by the target's continuation (exact: our loop, prompt lookup
    drafting), and the tokens generated."""
    out = generate(
        target, prompt, "prompt_lookup", max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, seed=seed,
    )  # fmt: skip
    tokenizer = target.tokenizer
    text = tokenizer.decode(prompt) + tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    return text, out.lengths[0]


def _replay_batch(
    target, conversations: list[Conversation], drafter, max_new_tokens, temperature, top_p, seed
) -> list[tuple[list[dict], int]]:
    """Each conversation with every assistant turn replaced by the target's answer, and the
    tokens generated for it. The n-th answers of all conversations are decoded as one batch."""
    tokenizer = target.tokenizer
    if not tokenizer.chat_template:
        raise DataError(
            f"{target.name}'s tokenizer has no chat template, so a conversation cannot be "
            "rendered for it (a base model such as gemma3-270m): regenerate plain text with "
            "--prompt-tokens N instead, or use a chat model"
        )
    histories: list[list[dict]] = [[] for _ in conversations]
    tokens = [0] * len(conversations)
    at = [0] * len(conversations)  # each conversation's next message
    for step in range(max(len(c.messages) for c in conversations)):
        asking = []
        for i, conversation in enumerate(conversations):
            messages = conversation.messages
            while at[i] < len(messages) and messages[at[i]].role != "assistant":
                histories[i].append(
                    {"role": messages[at[i]].role, "content": messages[at[i]].content}
                )
                at[i] += 1
            if at[i] < len(messages):
                asking.append(i)
        if not asking:
            break
        prompts = [
            tokenizer.apply_chat_template(
                histories[i], add_generation_prompt=True, return_dict=True
            )["input_ids"]
            for i in asking
        ]
        out = generate(
            target, prompts if len(prompts) > 1 else prompts[0], drafter,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            seed=seed * 1_000 + step,
        )  # fmt: skip
        for i, row in zip(asking, out.rows(), strict=True):
            reply = tokenizer.decode(row, skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": reply})  # exactly what it wrote
            tokens[i] += len(row)
            at[i] += 1
    return list(zip(histories, tokens, strict=True))


def _done_sources(output: Path) -> set[str]:
    """Sources already written to `output`; a last line cut off mid-write is removed first."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything up to the last complete line
    if keep < len(data):
        print(f"[specdraft] dropping a partial last line of {output}", file=sys.stderr)
        with output.open("r+b") as f:
            f.truncate(keep)
    done = set()
    for number, line in enumerate(data[:keep].splitlines(), 1):
        try:
            done.add(json.loads(line)["source"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(
                f"{output}:{number} is not a line this script wrote ({e}); pass a new --output "
                "or remove the file to start over"
            ) from None
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target = load_target(args.target, dtype=args.dtype, device=args.device)
        choose_threads(
            args.threads, target, log=lambda m: print(f"[regenerate] {m}", file=sys.stderr)
        )
        drafter = args.drafter
        if drafter not in (None, "prompt_lookup"):
            drafter = load_drafter(drafter, target)
        counts = regenerate(
            target, args.data, args.output, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed, limit=args.limit,
            fmt=args.format, prompt_tokens=args.prompt_tokens, stride=args.stride,
            name=args.name, split=args.split, batch_size=args.batch_size, drafter=drafter,
            log=lambda line: print(line, file=sys.stderr),
        )  # fmt: skip
    except ValueError as e:  # DataError, TargetError, a drafter of another target, --threads
        print(f"regenerate.py: error: {e}", file=sys.stderr)
        return 2
    print(f"[specdraft] {args.output}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data",
        required=True,
        help="conversations or text: a local file/folder, a hub id, demo (the demo corpus), or "
        "stdlib-requests (chat requests built from the standard library, data/requests.py)",
    )
    parser.add_argument("--name", default=None, help="a hub dataset's configuration name")
    parser.add_argument(
        "--split", default="train", help="a hub dataset's split (UltraChat 200k: train_sft)"
    )
    parser.add_argument("--output", required=True, help="the JSON lines file to write (appended)")
    parser.add_argument(
        "--target", default="demo",
        help=TARGET_HELP,
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int, default=16,
        help="conversations answered together, one batched decode per turn",
    )  # fmt: skip
    parser.add_argument(
        "--drafter", default=None,
        help="draft the answers: prompt_lookup or a drafter folder (default: plain decoding)",
    )  # fmt: skip
    add_threads_argument(parser)
    parser.add_argument("--format", default="auto", help="auto | sharegpt | messages | ultrachat")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="stop after this many new rows")
    parser.add_argument(
        "--prompt-tokens", type=int, default=0,
        help="continue plain text after its first N tokens (0: skip plain text)",
    )  # fmt: skip
    parser.add_argument(
        "--stride", type=int, default=0,
        help="with --prompt-tokens: also continue after every S further tokens of a text",
    )  # fmt: skip
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
