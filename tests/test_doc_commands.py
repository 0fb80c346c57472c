"""Every command in README.md, docs/*.md and configs/README.md runs (issue 32).

The commands are read from the docs as they are when the test runs (tests/doc_commands.py holds
the extraction rules, the checks and the placeholder rule); each documented script's `--help`
runs and its documented arguments go through the script's own parser, so a renamed config key or
option fails here, naming the doc, the line and the key, before a reader meets it. Nothing is
trained or built: a trainer's command line is only resolved through its config.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from doc_commands import Checker, Command, commands_in_text, doc_files, documented_commands

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checker() -> Checker:
    return Checker(ROOT)


def problems_of(checker: Checker, markdown: str) -> list[str]:
    commands = commands_in_text(textwrap.dedent(markdown), "synthetic.md")
    assert commands, "the snippet holds no command: the test would prove nothing"
    return [str(p) for p in checker.check_all(commands)]


@pytest.mark.parametrize(
    "doc", [p.relative_to(ROOT).as_posix() for p in doc_files(ROOT) if p.is_file()]
)
def test_documented_commands_run(checker: Checker, doc: str):
    commands = [c for c in documented_commands(ROOT) if c.doc == doc]
    problems = checker.check_all(commands)
    assert not problems, f"{len(problems)} documented command(s) fail:\n" + "\n".join(
        map(str, problems)
    )


def test_the_readme_documents_training():
    """The extraction finds the README's commands (a parser that found none would pass)."""
    commands = [c for c in documented_commands(ROOT) if c.doc == "README.md"]
    assert any("train/" in w for c in commands for w in c.words)


def test_a_renamed_config_key_fails_naming_it(checker: Checker):
    snippet = """
        Train:

        ```bash
        accelerate launch train/eagle.py drafter.ttt_stepz=3   # a renamed key
        ```
    """
    (problem,) = problems_of(checker, snippet)
    assert problem.startswith(
        "synthetic.md:5: accelerate launch train/eagle.py drafter.ttt_stepz=3"
    )
    assert "unknown key 'drafter.ttt_stepz'" in problem
    assert "did you mean 'drafter.ttt_steps'" in problem
    assert problems_of(checker, snippet.replace("ttt_stepz", "ttt_steps")) == []


def test_bad_values_files_and_options_fail(checker: Checker):
    problems = problems_of(
        checker,
        """
        ```sh
        python train/medusa.py lr=fast
        python train/eagle.py --config configs/eagle/none.yaml
        accelerate launch --config_file configs/accelerate/none.yaml train/layerskip.py
        python scripts/evaluate.py --output runs/x --frobnicate
        python scripts/evalute.py --output runs/x
        python scripts/memory_plan.py configs/shapes/llama-3.3-70b --gpus eight
        specdraft-train eagle
        pip install -c constraints.txt -e ".[gpu]"
        specdraft train eagle nokey=5
        python -m specdraft train medusa lr=fast
        accelerate launch -m specdraft train eagle drafter.ttt_stepz=3
        specdraft evalute --output runs/x
        specdraft tune runs/x --frobnicate
        ```
        """,
    )
    expected = [
        ("synthetic.md:3", "lr expects float"),
        ("synthetic.md:4", "config file not found: configs/eagle/none.yaml"),
        ("synthetic.md:5", "--config_file configs/accelerate/none.yaml does not exist"),
        ("synthetic.md:6", "unrecognized arguments: --frobnicate"),
        ("synthetic.md:7", "scripts/evalute.py does not exist"),
        ("synthetic.md:8", "argument --gpus: invalid int value: 'eight'"),
        ("synthetic.md:9", "'specdraft-train' is not a command this test knows"),
        ("synthetic.md:10", "no extra 'gpu' in pyproject.toml"),
        ("synthetic.md:11", "unknown key 'nokey'"),
        ("synthetic.md:12", "lr expects float"),
        ("synthetic.md:13", "unknown key 'drafter.ttt_stepz'"),
        ("synthetic.md:14", "specdraft evalute: no such command"),
        ("synthetic.md:15", "unrecognized arguments: --frobnicate"),
    ]
    for where, what in expected:
        assert any(p.startswith(where) and what in p for p in problems), (where, what, problems)
    assert len(problems) == len(expected), problems  # each named once


def test_commands_that_hold_run_clean(checker: Checker):
    snippet = """
        ```bash
        python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e ".[dev]"
        HF_HUB_OFFLINE=1 WANDB_MODE=offline pytest -q tests/test_layout.py
        git clone https://github.com/x/y && cd y   # another tool's commands are not checked
        accelerate launch --config_file configs/accelerate/cpu_2proc.yaml train/eagle.py \\
            --config configs/eagle/demo.yaml max_steps=5 data.max_length=64 2>&1 | tee train.log
        python train/medusa.py --config medusa2-demo.yaml   # found beside the kind's demo.yaml
        python scripts/evaluate.py --drafter runs/eagle-demo/final:tree_top_k=4 --output runs/e
        python -m specdraft.tools.export --format eagle runs/a/final exports/a
        python -c "import specdraft"
        vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config '{"method": "eagle3"}'
        ```
    """
    assert problems_of(checker, snippet) == []


def test_placeholders_are_not_problems_but_keys_beside_them_are(checker: Checker):
    snippet = """
        ```bash
        python scripts/evaluate.py --drafter FOLDER --num-prompts N --output <dir>
        accelerate launch train/eagle.py --config $RECIPE drafter.version=$VERSION $EXTRA
        python scripts/regenerate.py ...
        python scripts/dump_hidden_states.py --out cache/ ...
        ```
    """
    assert problems_of(checker, snippet) == []
    (problem,) = problems_of(
        checker, "```bash\naccelerate launch train/eagle.py drafter.versionz=$VERSION\n```"
    )
    assert "unknown key 'drafter.versionz'" in problem


def test_the_extraction_rules():
    markdown = textwrap.dedent(
        """
        ```bash
        # a comment line
        A=1 B="x y" python scripts/tune.py runs/a \\
            --dry-run   # trailing comment
        cd x && python scripts/compare.py; echo done | tee log 2>&1 > out.txt
        python train/eagle.py run_name=a#1
        ```

        ```console
        $ pytest -q
        12 passed
        ```

        ```
        specdraft/   the bottom: types, maths
        ```

        ```
        python scripts/tune.py runs/b
        ```

        ```python
        import os
        ```
        """
    )
    found = [(c.line, c.words) for c in commands_in_text(markdown, "x.md")]
    assert found == [
        (4, ("python", "scripts/tune.py", "runs/a", "--dry-run")),
        (6, ("cd", "x")),
        (6, ("python", "scripts/compare.py")),
        (6, ("echo", "done")),
        (6, ("tee", "log")),
        (7, ("python", "train/eagle.py", "run_name=a#1")),
        (11, ("pytest", "-q")),
        (20, ("python", "scripts/tune.py", "runs/b")),
    ]


def test_an_unreadable_line_is_a_problem(checker: Checker):
    (command,) = commands_in_text('```sh\npython scripts/tune.py "runs/a\n```', "x.md")
    assert isinstance(command, Command) and command.unreadable
    assert "cannot read" in checker.check(command)[0]
