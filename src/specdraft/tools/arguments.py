"""What the tools' command lines share: the parser, and the measuring tools' --prompts and
--num-prompts, --threads and --batch-sizes."""

from __future__ import annotations

import argparse

# the measuring modules (torch and the loop) are imported where an argument needs them: a tool
# that only builds a parser here (scripts/memory_plan.py) starts without them


def new_parser(doc: str, **options) -> argparse.ArgumentParser:
    """A tool's parser: `doc` (its module docstring, or a part) as the description, laid out as
    written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **options
    )


THREADS_HELP = "CPU threads (0: the count that runs the target fastest on the machine as it is now)"


def add_prompts_arguments(
    parser, prompts: str, num_prompts: int, first_turns: bool = False
) -> None:
    """Every measuring script's --prompts and --num-prompts (PROMPTS_HELP), with its defaults;
    first_turns: the script decodes each request's first turn only."""
    from specdraft.measuring.measure import PROMPTS_HELP

    parser.add_argument(
        "--prompts",
        default=prompts,
        help=PROMPTS_HELP + (" (their first turns)" if first_turns else ""),
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=num_prompts,
        help="requests taken (a named set's round-robin over its categories: 8 is one of each "
        "of MT-Bench's)" + ("" if first_turns else ", every turn of each measured"),
    )


def add_threads_argument(parser) -> None:
    """Every measuring script's --threads, which it hands to `choose_threads`; a negative count
    is refused by the parser."""

    def count(text: str) -> int:
        if not text.isdigit():
            raise argparse.ArgumentTypeError(
                f"must be an integer >= 0 (0: the fastest now), got {text!r}"
            )
        return int(text)

    parser.add_argument("--threads", type=count, default=0, help=THREADS_HELP)


def add_batch_sizes_argument(parser, help: str, default: str | None = "1", **options) -> None:
    """--batch-sizes "1,2,4,8,16", read by `parse_batch_sizes` into a sorted tuple; a bad one is
    the parser's error naming it."""

    from specdraft.measuring.evaluation import parse_batch_sizes

    def sizes(text: str) -> tuple[int, ...]:
        try:
            return parse_batch_sizes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument("--batch-sizes", type=sizes, default=default, help=help, **options)
