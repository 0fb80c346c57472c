"""Chat requests built from the Python standard library, for training drafters of chat models
offline.

A chat target's drafter should learn what the target answers to what users ask. With no hub
reachable there is no UltraChat or ShareGPT, but every machine carries the standard library:
its functions, classes and their documentation become user requests (explain, summarise, write a
function that ..., rewrite, review, test, show an example). The target answers them itself
(`scripts/regenerate.py --data stdlib-requests`: self-distillation, as EAGLE and Medusa train),
so what the drafter learns is the target's own distribution.

The requests are read with `ast` (nothing is imported), deterministic for a Python version, and
split into train and held-out by the same file hash as the demo corpus (data/stdlib_corpus.py), so a
held-out request never shares a source file with a training one.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Iterator
from pathlib import Path

from specdraft.data.stdlib_corpus import demo_corpus_files, round_robin, stdlib_root

# What a user asks about one documented function or class: (name, template). The template's
# fields: module, qualname, name, signature, doc (the whole docstring), summary (its first
# paragraph) and source (the definition, at most MAX_SOURCE_LINES lines).
KINDS = (
    ("explain", "Explain what `{module}.{qualname}` in Python's standard library does, and "
     "when I would use it."),
    ("summarise", "Summarise this documentation in two or three sentences:\n\n{doc}"),
    ("write", "Write a Python function `{name}{signature}` that does the following:\n\n"
     "{summary}"),
    ("rewrite", "Rewrite this Python code so that it is easier to read, keeping what it "
     "does:\n\n```python\n{source}\n```"),
    ("review", "What does this Python code do? Answer briefly.\n\n```python\n{source}\n```"),
    ("test", "Write a unit test with pytest for this function:\n\n```python\n{source}\n```"),
    ("example", "Show me a short example of how to use `{module}.{qualname}`, with a "
     "sentence on what it prints."),
)  # fmt: skip
MAX_SOURCE_LINES = 40
MAX_DOC_CHARS = 1500


def stdlib_requests(n: int | None = None, split: str = "train") -> list[dict]:
    """Up to `n` (None: all) single-turn requests from the standard library files of `split`
    ("train" or "heldout"), as rows `{"messages": [{"role": "user", ...}], "source": ...}`.
    Taken round-robin over files (one definition of each file, then the next ...), so a small n
    still spans the library; each definition gets one kind of request, chosen by a hash of its
    name. Deterministic."""
    if n is not None and n < 1:
        raise ValueError(f"stdlib_requests needs n >= 1 (or None for all), got {n}")
    root = stdlib_root()
    files = [p for p in demo_corpus_files(split) if not _private(p.relative_to(root))]
    return round_robin([list(_requests(path)) for path in files], n)


def _private(rel: Path) -> bool:
    """A private module (`_pydecimal`, `concurrent/futures/_base`): not what users ask about."""
    return any(part.startswith("_") and part != "__init__.py" for part in rel.parts)


def _requests(path: Path) -> Iterator[dict]:
    """One request for each public documented function or class of the file at `path`."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    rel = path.relative_to(stdlib_root()).as_posix()
    module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    lines = text.splitlines()
    for qualname, node in _definitions(tree):
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        source = lines[node.lineno - 1 : node.end_lineno]
        fields = {
            "module": module,
            "qualname": qualname,
            "name": node.name,
            "signature": _signature(node),
            "doc": doc[:MAX_DOC_CHARS],
            "summary": inspect.cleandoc(doc.split("\n\n")[0]),
            "source": textwrap.dedent("\n".join(source)),
        }
        kinds = [k for k in KINDS if k[0] != "write" or isinstance(node, ast.FunctionDef)]
        if len(source) > MAX_SOURCE_LINES:
            kinds = [k for k in kinds if "{source}" not in k[1]]
        digest = hashlib.sha1(f"{module}.{qualname}".encode()).digest()
        kind, template = kinds[int.from_bytes(digest[:4], "big") % len(kinds)]
        yield {
            "messages": [{"role": "user", "content": template.format(**fields)}],
            "source": f"stdlib/{rel}:{qualname}:{kind}",
        }


def _definitions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) for the module's public functions and classes and the public
    methods of its public classes, in source order."""
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
            continue
        yield node.name, node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


def _signature(node: ast.AST) -> str:
    """A function's parameters as written, `self` and annotations left out: "(path, mode='r')"."""
    if not isinstance(node, ast.FunctionDef):
        return "()"
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args) if a.arg not in ("self", "cls")]
    defaults = [ast.unparse(d) for d in args.defaults]
    shown = names[: len(names) - len(defaults)] if defaults else list(names)
    shown += [
        f"{a}={d}" for a, d in zip(names[len(names) - len(defaults) :], defaults, strict=False)
    ]
    if args.vararg:
        shown.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        shown.append("*")
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        shown.append(a.arg if d is None else f"{a.arg}={ast.unparse(d)}")
    if args.kwarg:
        shown.append(f"**{args.kwarg.arg}")
    return f"({', '.join(shown)})"
