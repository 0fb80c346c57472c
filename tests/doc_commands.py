"""The shell commands of the docs, extracted and checked against the code (issue 32).

`documented_commands(root)` reads README.md, docs/*.md and configs/README.md; `Checker(root)`
checks each command without running anything heavy, and says what is wrong with it.

Which fenced blocks are shell:
- a block labelled bash, sh, shell, zsh or console (in a console block only the lines after a
  `$ ` prompt are commands; the rest is output);
- an unlabelled block whose every command starts with a program this module knows (a Python
  entry, accelerate, pytest, pip, a script path or one of EXTERNAL); a block of anything else
  (the layout trees of docs/architecture.md) is prose;
- any other label (python, yaml, text) is not shell.

How a block becomes commands: a line ending in a backslash joins the next; a `#` at the start
of a word begins a comment; redirections (`> log`, `2>&1`) are dropped; `&&`, `||`, `;`, `|`
and `&` separate commands; leading `NAME=value` assignments (and `env`) are stripped. Each
command keeps the doc's file and the line it starts on.

What is checked:
- `python FILE ...` and `accelerate launch [its options] FILE ...`: the file exists; for a .py
  file of the repository, its `main(["--help"])` exits 0, and the documented arguments parse:
  through the script's `parse_args(argv)` (scripts/), or for a trainer (train/:
  a TrainConfig subclass and DEFAULT_CONFIG) through `specdraft.config.parse_cli`, exactly as
  its `main` reads `--config` and `key=value`, so an unknown key or a bad value fails with the
  config parser's own message. accelerate's options go through accelerate's own parser.
- `python -m specdraft.X` as the file it names, `specdraft train KIND` as train/KIND.py and
  `specdraft TOOL` as its module in src/specdraft/tools (`python -m specdraft`: the same); `python -m venv`,
  `python -m pip`, `python -m pytest` as those tools; another `-m` module is another tool's.
- `python -c CODE` compiles; `pytest` names test paths that exist; `pip install` names
  constraint/requirement files that exist, and `-e PATH[extras]` a project with those extras;
  a script run by its path (`scripts/gpu_check.sh`) exists and is executable.
- every `configs/...` path in any command exists.
- programs in EXTERNAL (git, cd, vllm, ...) are recognised and not checked; any other program
  is a problem, so a misspelt script name cannot pass as "someone else's tool".

Placeholders, kept narrow: a word that is `...` (or `…`) elides the rest of its command (the
words before it are checked; a missing required argument is then not a problem). A placeholder
is `<name>`, `$VAR` / `${VAR}`, or a word in capitals (FOLDER, OUT_DIR), whole or as the value
of `key=` / `--opt=`: for a trainer, `key=PLACEHOLDER` checks the key but not its
value, `--config PLACEHOLDER` reads the default config, and a bare placeholder word (standing
for arguments) is dropped; for an argparse script, an error that quotes a placeholder is
forgiven by dropping that word (and the option it is the value of) and parsing again; a path
holding a placeholder is not looked up.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

SHELL_LABELS = {"bash", "sh", "shell", "zsh", "console"}
# Other tools' programs a doc may show: recognised, not checked. Add one here when a doc needs it.
EXTERNAL = {
    ".", "source", "cd", "export", "env", "echo", "mkdir", "ls", "cat", "head", "tail", "tee",
    "cp", "mv", "rm", "du", "df", "tar", "curl", "wget", "git", "docker", "nvidia-smi", "watch",
    "huggingface-cli", "hf", "wandb", "tensorboard", "vllm", "deepspeed", "torchrun", "uv",
    "llama-server",
}  # fmt: skip
PYTHON = re.compile(r"(.*/)?python(\d+(\.\d+)?)?$")
ELIDED = {"...", "…"}
_PLACEHOLDER = re.compile(r"<[A-Za-z][\w.-]*>|\$\{?\w+\}?")
_CAPITALS = re.compile(r"[A-Z][A-Z0-9_]*")
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
_REDIRECT = re.compile(r"(?<!\S)(\d*>>?|&>)\s*(&\d+|[^\s;|&]+)|(?<!\S)<\s+[^\s;|&]+")
_SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}


@dataclass(frozen=True)
class Command:
    doc: str  # the doc's path, relative to the repository root
    line: int  # the line the command starts on
    words: tuple[str, ...]
    unreadable: str = ""  # why the shell cannot read the line (the words are then the line)

    def __str__(self) -> str:
        return self.words[0] if self.unreadable else shlex.join(self.words)


@dataclass(frozen=True)
class Problem:
    command: Command
    problem: str

    def __str__(self) -> str:
        return f"{self.command.doc}:{self.command.line}: {self.command}\n    -> {self.problem}"


def is_placeholder(word: str) -> bool:
    """A word standing for something the reader fills in (see the module's docstring)."""
    value = word.split("=", 1)[1] if "=" in word else word
    return bool(_PLACEHOLDER.search(word)) or bool(_CAPITALS.fullmatch(value)) or word in ELIDED


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "configs/README.md"]


def documented_commands(root: Path) -> list[Command]:
    return [c for path in doc_files(root) if path.is_file() for c in commands_in(path, root)]


def commands_in(path: Path, root: Path) -> list[Command]:
    return commands_in_text(path.read_text(encoding="utf-8"), path.relative_to(root).as_posix())


def commands_in_text(text: str, doc: str) -> list[Command]:
    """The commands of the shell blocks of markdown `text`, each with `doc` and its first line."""
    out = []
    for label, lines in fenced_blocks(text):
        block = [Command(doc, n, *w) for n, w in block_commands(lines, label == "console")]
        if label in SHELL_LABELS or (label == "" and block and all(map(_known, block))):
            out += block
    return out


def fenced_blocks(text: str) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """(label, [(line number, line), ...]) of each fenced block, the label lowercased."""
    fence, label, lines = None, "", []
    for n, line in enumerate(text.splitlines(), 1):
        match = re.match(r"\s*(`{3,}|~{3,})\s*([^\s`]*)", line)
        if fence is None and match:
            fence, label, lines = match[1], match[2].lower(), []
        elif fence is not None and re.fullmatch(rf"\s*{fence}{fence[0]}*\s*", line):
            yield label, lines
            fence = None
        elif fence is not None:
            lines.append((n, line))


def block_commands(
    lines: list[tuple[int, str]], console: bool
) -> list[tuple[int, tuple[tuple[str, ...], str]]]:
    """(first line, (words, "")) of each command in a block's lines; (line, ((text,), why))
    for a line the shell cannot read (unbalanced quotes)."""
    joined: list[tuple[int, str]] = []  # continuation lines joined, with their first line
    pending: tuple[int, str] | None = None
    for n, line in lines:
        if pending is None:
            text = line.strip()
            if console:
                if not text.startswith("$ "):
                    continue  # output
                text = text[2:]
            pending = (n, "")
        else:
            text = line.strip()
        start, before = pending
        if text.endswith("\\"):
            pending = (start, before + text[:-1] + " ")
        else:
            joined.append((start, before + text))
            pending = None
    if pending is not None:
        joined.append(pending)
    out = []
    for n, text in joined:
        try:
            out += [(n, (tuple(words), "")) for words in split_commands(text)]
        except ValueError as e:  # shlex: "No closing quotation"
            out.append((n, ((text,), str(e))))
    return out


def split_commands(text: str) -> list[list[str]]:
    """The commands of one shell line: comments and redirections dropped, split at `&&`, `||`,
    `;`, `|` and `&`, leading assignments (and `env`) stripped."""
    text = _REDIRECT.sub(" ", _strip_comment(text))
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";|&")
    lexer.whitespace_split, lexer.commenters = True, ""
    commands, words = [], []
    for token in [*lexer, ";"]:
        if token in _SEPARATORS:
            while words and (_ASSIGNMENT.match(words[0]) or words[0] == "env"):
                words.pop(0)
            if words:
                commands.append(words)
            words = []
        else:
            words.append(token)
    return commands


def _strip_comment(text: str) -> str:
    """The line up to a `#` that starts a word outside quotes, as the shell reads it."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i]
    return text


def _known(command: Command) -> bool:
    """Whether an unlabelled block's command starts with a program this module knows."""
    program = command.words[0]
    return not command.unreadable and bool(
        PYTHON.match(program)
        or program in EXTERNAL | {"accelerate", "pytest", "pip", "pip3", "specdraft"}
        or re.match(r"(\./)?(scripts|train|benchmarks)/", program)
    )


# --- checking -----------------------------------------------------------------------------------


class Checker:
    """Checks commands against the repository at `root`; `check` returns the problems found.

    Modules are loaded once per checker, by path (as `python FILE` runs them), and each script's
    `--help` is run once.
    """

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.pyproject = tomllib.loads((self.root / "pyproject.toml").read_text(encoding="utf-8"))
        self._modules: dict[str, Any] = {}
        self._help: dict[str, str | None] = {}

    def check_all(self, commands: list[Command]) -> list[Problem]:
        with _cwd(self.root):  # the docs' commands run from the repository root
            return [Problem(c, p) for c in commands for p in self.check(c)]

    def check(self, command: Command) -> list[str]:
        if command.unreadable:
            return [f"the shell cannot read this line: {command.unreadable}"]
        words = list(command.words)
        problems: list[str] = []
        program, args = words[0], words[1:]
        if PYTHON.match(program):
            problems += self._python(args)
        elif program == "accelerate":
            problems += self._accelerate(args)
        elif program == "pytest":
            problems += self._pytest(args)
        elif program in ("pip", "pip3"):
            problems += self._pip(args)
        elif program == "specdraft":
            problems += self._specdraft(args)
        elif re.match(r"(\./)?(scripts|train|benchmarks)/", program):
            path = self.root / program
            if not path.is_file():
                problems.append(f"{program} does not exist")
            elif path.suffix == ".py":
                problems += self._script(program, args)
            elif not os.access(path, os.X_OK):
                problems.append(f"{program} is not executable (chmod +x)")
        elif program not in EXTERNAL:
            problems.append(
                f"{program!r} is not a command this test knows: a misspelt script? If it is "
                "another tool's, add it to EXTERNAL in tests/doc_commands.py"
            )
        missing = {  # any configs/ path, unless a parser above named it already
            path
            for w in words
            for path in [w.rsplit("=", 1)[-1]]
            if path.startswith("configs/") and not is_placeholder(path)
            if not (self.root / path).exists()
        }
        return problems + [
            f"{path} does not exist"
            for path in sorted(missing)
            if not any(path in p for p in problems)
        ]

    def _python(self, args: list[str]) -> list[str]:
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
            args = args[1:]  # the interpreter's own options (-u, -O)
        if not args:
            return []  # an interactive interpreter
        if args[0] == "-c":
            try:
                compile(args[1] if len(args) > 1 else "", "<python -c>", "exec")
            except SyntaxError as e:
                return [f"python -c: {e}"]
            return []
        if args[0] == "-m":
            module, rest = (args[1] if len(args) > 1 else ""), args[2:]
            if module == "pytest":
                return self._pytest(rest)
            if module == "pip":
                return self._pip(rest)
            if module == "specdraft":
                return self._specdraft(rest)
            path = self._module_path(module)
            return self._script(path, rest) if path else []  # another tool's module
        return self._script(args[0], args[1:])

    def _module_path(self, module: str) -> str | None:
        """The repository file of a `python -m` module (the library is src/), or None."""
        if module == "specdraft":
            return "src/specdraft/cli.py"
        path = "src/" + module.replace(".", "/") + ".py"
        return path if (self.root / path).is_file() else None

    def _specdraft(self, args: list[str]) -> list[str]:
        """`specdraft train KIND ...` as train/KIND.py, `specdraft TOOL ...` as the tool's
        module; `specdraft`, `--help` and `configs` take no arguments to check."""
        if not args or args[0] in ("-h", "--help", "configs"):
            return []
        if args[0] == "train":
            if len(args) < 2 or args[1] in ("-h", "--help"):
                return []
            return self._script(f"train/{args[1]}.py", args[2:])
        tool = f"src/specdraft/tools/{args[0].replace('-', '_')}.py"
        if not (self.root / tool).is_file():
            return [f"specdraft {args[0]}: no such command (src/specdraft/tools/ has no module)"]
        return self._script(tool, args[1:])

    def _accelerate(self, args: list[str]) -> list[str]:
        if not args or args[0] != "launch":
            return []  # accelerate config, env, ...
        from accelerate.commands.launch import launch_command_parser

        code, out = _call(launch_command_parser().parse_args, args[1:])
        if code not in (None, 0):
            return [f"accelerate launch: {_last_error(out)}"]
        if code == 0 or not isinstance(out, argparse.Namespace):
            return []  # accelerate launch --help
        problems = []
        config_file = out.config_file
        if config_file and not is_placeholder(config_file) and not Path(config_file).exists():
            problems.append(f"--config_file {config_file} does not exist")
        if getattr(out, "module", False) and out.training_script == "specdraft":
            return problems + self._specdraft(out.training_script_args)
        return problems + self._script(out.training_script, out.training_script_args)

    def _pytest(self, args: list[str]) -> list[str]:
        paths = [a.split("::")[0] for a in args if a.startswith("tests")]
        return [f"{p} does not exist" for p in paths if not (self.root / p).exists()]

    def _pip(self, args: list[str]) -> list[str]:
        if not args or args[0] != "install":
            return []
        problems = []
        for option, value in itertools.pairwise(args):
            is_file_option = option in ("-c", "--constraint", "-r", "--requirement")
            if is_file_option and not (self.root / value).is_file():
                problems.append(f"{option} {value}: no such file")
            if option in ("-e", "--editable") and not re.match(r"\w+(\+\w+)?://", value):
                path, _, extras = value.partition("[")
                if not (self.root / path / "pyproject.toml").is_file():
                    problems.append(f"-e {value}: {path} holds no pyproject.toml")
                    continue
                known = self.pyproject["project"].get("optional-dependencies", {})
                for extra in filter(None, extras.rstrip("]").split(",")):
                    if extra.strip() not in known:
                        problems.append(f"-e {value}: no extra {extra!r} in pyproject.toml")
        return problems

    def _script(self, script: str, args: list[str]) -> list[str]:
        """A Python file of the repository run with `args`: it exists, --help works, and the
        arguments parse through the script's own parser."""
        if is_placeholder(script):
            return []
        path = (self.root / script).resolve()
        if not path.is_file():
            return [f"{script} does not exist"]
        if not path.is_relative_to(self.root):
            return []  # not ours
        if any(w in ELIDED for w in args):
            args, elided = args[: next(i for i, w in enumerate(args) if w in ELIDED)], True
        else:
            elided = False
        rel = path.relative_to(self.root).as_posix()
        try:
            module = self._module(rel)
        except Exception as e:  # any import failure is the problem to report
            return [f"{rel} does not import: {type(e).__name__}: {e}"]
        problems = []
        if rel not in self._help:
            code, out = _call(_main_of(module), ["--help"])
            if code is None:
                self._help[rel] = f"{rel} --help returned {out!r} instead of exiting after its help"
            else:
                self._help[rel] = None if code == 0 else f"{rel} --help: {_last_error(out)}"
        if self._help[rel]:
            problems.append(self._help[rel])
        if "-h" in args or "--help" in args:
            return problems
        config = _train_config(module)
        if hasattr(module, "parse_args"):
            problems += [f"{rel}: {p}" for p in _parse_with(module.parse_args, args, elided)]
        elif config is not None:
            problems += [f"{rel}: {p}" for p in self._parse_config(module, config, rel, args)]
        else:
            problems.append(
                f"{rel} exposes no parse_args(argv) (as scripts/evaluate.py does), so its "
                "documented arguments cannot be checked"
            )
        return problems

    def _parse_config(self, module: Any, config: type, prog: str, args: list[str]) -> list[str]:
        """A trainer's command line, read as its main reads it (parse_cli)."""
        from specdraft.config import parse_cli

        args = [p for w in args for p in (w.split("=", 1) if w.startswith("--config=") else [w])]
        i = args.index("--config") if "--config" in args else -1
        if i >= 0 and i + 1 < len(args) and is_placeholder(args[i + 1]):
            del args[i : i + 2]  # the default config stands in for the reader's file
        args = [w for w in args if "=" in w or w.startswith("-") or not is_placeholder(w)]
        settled = [w for w in args if not ("=" in w and is_placeholder(w))]
        if len(settled) < len(args):  # key=PLACEHOLDER: check the key, with the value it has
            code, out = _call(parse_cli, config, settled, module.DEFAULT_CONFIG, prog=prog)
            if code is not None:
                return [_last_error(out)]
            for w in args:
                if "=" in w and is_placeholder(w):
                    key = w.split("=", 1)[0]
                    args[args.index(w)] = f"{key}={_value_json(out, key)}"
        code, out = _call(parse_cli, config, args, module.DEFAULT_CONFIG, prog=prog)
        return [] if code is None else [_last_error(out)]

    def _module(self, rel: str) -> Any:
        """The file at `rel`, loaded once by path, as `python FILE` runs it (not as __main__);
        for a checkout launcher (train/KIND.py, scripts/TOOL.py) or a file of the library, the
        library module it runs."""
        library = _library_module(self.root, rel)
        if library is not None:
            return importlib.import_module(library)
        if rel not in self._modules:
            name = "_doc_commands." + rel.removesuffix(".py").replace("/", ".")
            spec = importlib.util.spec_from_file_location(name, self.root / rel)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and typing look their module up here
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            self._modules[rel] = module
        return self._modules[rel]


def _library_module(root: Path, rel: str) -> str | None:
    """The library module a repository file stands for: itself under src/, the trainer a
    train/KIND.py launcher runs, the tool a scripts/TOOL.py launcher runs; None for others."""
    parts = Path(rel.removesuffix(".py")).parts
    if parts[0] == "src":
        return ".".join(parts[1:])
    if len(parts) == 2 and parts[0] == "train":
        return f"specdraft.kinds.{parts[1]}.{parts[1]}_trainer"
    tool = root / "src" / "specdraft" / "tools" / f"{parts[-1]}.py"
    if len(parts) == 2 and parts[0] == "scripts" and tool.is_file():
        return f"specdraft.tools.{parts[1]}"
    return None


def _main_of(module: Any) -> Any:
    """What runs a module's command line: its main, or for a trainer the shared entry's."""
    if hasattr(module, "main"):
        return module.main
    from functools import partial

    from specdraft.train.entry import main

    return partial(main, module.__name__.rpartition(".")[2].removesuffix("_trainer"))


def _train_config(module: Any) -> type | None:
    """A trainer's config class: the TrainConfig subclass it defines."""
    from specdraft.train.train_config import TrainConfig

    if not hasattr(module, "DEFAULT_CONFIG"):
        return None
    found = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, TrainConfig) and v.__module__ == module.__name__
    ]
    return found[0] if len(found) == 1 else None


def _parse_with(parse_args: Any, args: list[str], elided: bool) -> list[str]:
    """Problems of `parse_args(args)`; an error that quotes a placeholder drops that word (and
    the option before it) and parses again."""
    args, dropped = list(args), False
    while True:
        code, out = _call(parse_args, args)
        if code is None:
            return []
        error = _last_error(out)
        if "arguments are required" in error and (elided or dropped):
            return []
        quoted = [w for w in args if is_placeholder(w) and w in error]
        if not quoted:
            return [error]
        i = args.index(quoted[0])
        start = i - 1 if i > 0 and args[i - 1].startswith("-") and "=" not in args[i] else i
        del args[start : i + 1]
        dropped = True


def _value_json(cfg: Any, key: str) -> str:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part, None)
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return json.dumps(value, default=str)


def _call(fn: Any, *args: Any, **kwargs: Any) -> tuple[int | None, Any]:
    """(None, the result) or (the exit code, what it printed) of `fn`, its output captured."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")  # ConfigNote and library warnings are not problems
            result = fn(*args, **kwargs)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        printed = err.getvalue() + ("" if isinstance(e.code, int | None) else str(e.code))
        return code, printed or out.getvalue()
    except Exception as e:  # what a parser raises is the problem to report
        return 1, f"{type(e).__name__}: {e}"
    return None, result


def _last_error(printed: Any) -> str:
    """The line of a parser's output that says what is wrong (argparse's `error:` line)."""
    lines = [line.strip() for line in str(printed).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    line = errors[-1] if errors else (lines[-1] if lines else "failed, printing nothing")
    return re.sub(r"^\S+: error: ", "", line)  # argparse's prog is the test runner's name


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)
