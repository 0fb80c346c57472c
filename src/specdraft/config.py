"""Typed configs: dataclasses, YAML files and key=value overrides (docs/architecture.md, "Config").

The one config engine of specdraft: training configs (train/train_config.py), decoding settings
(`--drafter FOLDER:key=value` in scripts/evaluate.py) and any other dataclass section go through
it. A config is built in three layers, each later one winning:

1. the dataclass defaults (e.g. `TrainConfig`, or a drafter kind's subclass of it),
2. a YAML file (`configs/<kind>/demo.yaml` or a recipe),
3. `key=value` overrides from the command line, dotted for nesting (`data.max_length=256`).

OmegaConf structured configs do the merging and the type checks; this module adds what users see:
an unknown key, a value of the wrong type or outside a field's `choice(...)` is a `ConfigError`
naming the dotted key and where it was set (the file and line, or the command-line item);
`--help` lists every key with the comment above its field; `save_config` writes the resolved
config, which loads back to an equal object. `override` applies key=value items to an existing
config object through the same checks.

YAML scalars are read as text (only `null`, `~` and an empty value are None) and OmegaConf
converts the text to each field's type, so `lr: 3e-4` is a float, `mixed_precision: no` is the
string "no" (not PyYAML's False) and `run_name: 1e3` stays "1e3".
"""

import argparse
import dataclasses
import difflib
import importlib.resources
import inspect
import os
import re
import sys
import textwrap
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be built. The message names the key, where it was set and what to do.

    `key` is the dotted key at fault (None when the problem is the file as a whole).
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


# Every kind's configs (KIND/demo.yaml and its recipes), the accelerate and DeepSpeed files: package
# data, so an installed wheel has them (the checkout's configs/ links here)
SHIPPED_CONFIGS = Path(str(importlib.resources.files("specdraft") / "configs"))


def configs_folder() -> Path:
    """Where each kind's default config, KIND/demo.yaml, is read from: the folder
    SPECDRAFT_CONFIGS names (a team's own defaults; the test suite's tiny-target ones), else the
    shipped ones."""
    return Path(os.environ.get("SPECDRAFT_CONFIGS") or SHIPPED_CONFIGS)


def default_config(kind: str) -> Path:
    """A kind's default config: `configs_folder()`/KIND/demo.yaml."""
    return configs_folder() / kind / "demo.yaml"


# --- building a config: layers merged by OmegaConf, errors traced back to their layer -----------


def choice(*options: str) -> Any:
    """A str config field limited to `options`; the first is the default. The options live in
    the field's metadata, so loading (`check_choices`) and `--help` use the same tuple (OmegaConf
    has no `Literal`, hence this instead of a type)."""
    return field(default=options[0], metadata={"choices": options})


def follows(key: str, default: Any = None) -> Any:
    """A config field whose value belongs to the sibling `key` it follows (EAGLE's `ttt_steps`
    follows `version`): a layer that changes `key` drops what earlier layers set for this field,
    so a file's choice for one version does not carry into another chosen on the command line.
    The layer's own value for the field, and later layers', still apply."""
    return field(default=default, metadata={"follows": key})


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Build a `cls` from its defaults, the YAML file at `path` (None: none) and `overrides`.

    Overrides are `key=value` strings, dotted for nesting (`data.max_length=256`); values are YAML
    (`lr=3e-4`, `tags=[a,b]`, `resume_from=null`). A key set in the file keeps its siblings'
    defaults: `data: {max_length: 256}` changes one key of `data`, not the whole section.
    Raises ConfigError naming the key and the file (with its line) or the command line.
    """
    layers = [_read_file(Path(path))] if path is not None else []
    layers += _read_items(overrides, "command line")
    return _build(cls, OmegaConf.structured(cls), layers)


def override(obj: T, items: Sequence[str], source: str = "command line") -> T:
    """A copy of the config dataclass `obj` with `key=value` items applied (dotted for nesting).

    The same reading and checks as `load_config`'s overrides: an unknown key, a wrong type or a
    value outside a field's choices is a ConfigError naming the key and `source` (e.g.
    "--drafter runs/x"); the copy's `__post_init__` runs, so its own checks apply too.
    """
    # obj's values as the first layer, so that an item changing what a field follows drops it
    given = _Layer("the config given", config_to_dict(obj))
    return _build(type(obj), OmegaConf.structured(type(obj)), [given, *_read_items(items, source)])


def check_choices(obj: Any, prefix: str = "") -> None:
    """Raise ConfigError naming the dotted key of any `choice` field whose value is not one of its
    options, in `obj` (a config dataclass or its OmegaConf form) and its nested sections."""
    cls = OmegaConf.get_type(obj) if isinstance(obj, DictConfig) else type(obj)
    if not dataclasses.is_dataclass(cls):
        return
    for f in dataclasses.fields(cls):
        value, key = getattr(obj, f.name), _dotted(prefix, f.name)
        options = f.metadata.get("choices")
        if options and value not in options:
            raise ConfigError(f"{key}={value!r} is not one of: {' | '.join(options)}", key=key)
        if isinstance(value, DictConfig) or dataclasses.is_dataclass(value):
            check_choices(value, key)


@dataclass
class _Layer:
    """One source of values: a file or one `key=value` item, as nested dicts of YAML text."""

    source: str  # the file path, or "command line (item)"
    values: dict[str, Any]
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> line in the file

    def where(self, key: str | None) -> str:
        line = self.lines.get(key or "")
        return f"{self.source}, line {line}" if line else self.source

    def dotted_keys(self, values: Any = None, prefix: str = "") -> list[str]:
        """Every dotted key this layer sets, sections included, in the order written."""
        out = []
        for name, value in (self.values if values is None else values).items():
            out.append(_dotted(prefix, name))
            if isinstance(value, dict):
                out += self.dotted_keys(value, _dotted(prefix, name))
        return out


def _build(cls: type[T], config: DictConfig, layers: list[_Layer]) -> T:
    for i, layer in enumerate(layers):
        _drop_followers(cls, config, layer, layers[:i])
        try:
            config = OmegaConf.merge(config, layer.values)
            check_choices(config)  # the earlier layers passed, so a bad choice is this layer's
        except ConfigError as e:
            raise ConfigError(f"{layer.where(e.key)}: {e}", key=e.key) from None
        except OmegaConfBaseException as e:
            raise _merge_error(cls, layer, e) from None
    try:
        return OmegaConf.to_object(config)  # type: ignore[return-value]
    except ValueError as e:  # OmegaConf's (interpolations resolve here) or a __post_init__'s
        raise _blame(cls, layers, e) from None


def _drop_followers(cls: type, config: DictConfig, layer: _Layer, earlier: list[_Layer]) -> None:
    """Reset to its default every `follows` field that `earlier` layers of another source set,
    in each section where `layer` changes the key it follows; warn naming what was dropped."""
    sets = set(layer.dotted_keys())
    for section, tp in _sections(cls):
        followers: dict[str, list[dataclasses.Field]] = {}
        for f in dataclasses.fields(tp):
            if "follows" in f.metadata:
                followers.setdefault(f.metadata["follows"], []).append(f)
        for key, fields in followers.items():
            leader = _dotted(section, key)
            new = _value_at(layer.values, leader)
            if (
                leader not in sets
                or new is None
                or str(new) == str(OmegaConf.select(config, leader))
            ):
                continue
            choices = next(
                f.metadata.get("choices") for f in dataclasses.fields(tp) if f.name == key
            )
            if choices and str(new) not in choices:
                continue  # the merge refuses it, naming the choices: nothing to drop first
            dropped = []
            for f in fields:
                name = _dotted(section, f.name)
                # the same source (the command line's items) is one choice, in any order
                setters = [x for x in earlier if name in x.dotted_keys()]
                if name in sets or not setters or _origin(setters[-1]) == _origin(layer):
                    continue
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # fmt: skip
                if OmegaConf.select(config, name) == default:
                    continue  # nothing set to drop
                OmegaConf.update(config, name, default, merge=False)
                dropped.append(f"{name} (set in {setters[-1].where(name)})")
            if dropped:
                warnings.warn(
                    f"{layer.where(leader)}: {leader} changes to {new}, so what was set for the "
                    f"previous {key} is dropped and {new}'s defaults apply: {', '.join(dropped)}; "
                    "set them on the command line to keep them",
                    ConfigNote,
                    stacklevel=4,
                )


class ConfigNote(UserWarning):
    """A config value dropped because a later layer changed what it belongs to."""


def _sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted section, its dataclass) for `cls` and every dataclass section inside it."""
    out = [(prefix, cls)]
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp) and name in {f.name for f in dataclasses.fields(cls)}:
            out += _sections(tp, _dotted(prefix, name))
    return out


def _origin(layer: _Layer) -> str:
    return layer.source.partition(" (")[0]


def _value_at(values: dict, key: str) -> Any:
    for part in key.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def _merge_error(cls: type, layer: _Layer, e: OmegaConfBaseException) -> ConfigError:
    """OmegaConf's refusal, reworded as: where, which key, what it expects, what it got."""

    def value_of(key: str) -> Any:
        return _value_at(layer.values, key)

    key = e.full_key
    if key is None:  # a value given for a whole section, which OmegaConf does not name
        sections = [k for k in layer.dotted_keys() if dataclasses.is_dataclass(_field_type(cls, k))]
        key = next((k for k in sections if not isinstance(value_of(k), dict)), None)
        if key is None:
            return ConfigError(f"{layer.source}: {_first_line(e)}")
    key = re.sub(r"\[\d+\]$", "", key)  # a list item's error is the list's
    where, tp = layer.where(key), _field_type(cls, key)
    if isinstance(e, ConfigKeyError):
        section, _, name = key.rpartition(".")
        parent = _field_type(cls, section)
        names = [f.name for f in dataclasses.fields(parent)] if parent else []
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        todo = (
            "did you mean " + " or ".join(repr(_dotted(section, c)) for c in close) + "?"
            if close
            else f"valid keys in {section or 'the top level'}: {', '.join(names)}"
        )
        return ConfigError(f"{where}: unknown key {key!r}; {todo}", key=key)
    if isinstance(e, InterpolationResolutionError):  # a ${...} in the value
        return ConfigError(f"{where}: {key}: {_first_line(e)}", key=key)
    if dataclasses.is_dataclass(tp):
        expected = f"a section of keys ({key}.{dataclasses.fields(tp)[0].name}=...)"
    elif "list[" in _type_name(tp):
        expected = f"{_type_name(tp)} (write lists as [a,b])"
    else:
        expected = _type_name(tp)
    return ConfigError(f"{where}: {key} expects {expected}; got {value_of(key)!r}", key=key)


def _blame(cls: type, layers: list[_Layer], e: ValueError) -> ConfigError:
    """The error of building the object, prefixed with the layer that set the key at fault.

    A `__post_init__` cannot know where a value came from: the last layer that set the key did.
    A ConfigError names its key (a section's own relative to the section: `heads` for
    `drafter.heads`); for another ValueError, a key counts if the message names it in full or
    starts with its last part (`gamma must be >= 1` from a `decode` section).
    """
    key = e.full_key if isinstance(e, OmegaConfBaseException) else getattr(e, "key", None)
    message, end = _first_line(e), r"(?![\w]|\.\w)"
    for layer in reversed(layers):
        for k in reversed(layer.dotted_keys()):
            if key:
                hit = k == key or k.endswith(f".{key}")
            else:
                hit = re.search(rf"(?<![\w.]){re.escape(k)}{end}", message) or re.match(
                    rf"{re.escape(k.rpartition('.')[2])}{end}", message
                )
            if hit:
                return ConfigError(f"{layer.where(k)}: {message}", key=k)
    sources = ", ".join(x.source for x in layers) or "its defaults"
    return ConfigError(f"{cls.__name__} from {sources}: {message}", key=key)


# --- reading YAML: plain scalars stay text, so each field's type decides what they mean ---------


class _Loader(yaml.SafeLoader):
    """Safe YAML whose plain scalars stay text; only `null`, `~` and an empty value are None."""

    yaml_implicit_resolvers: ClassVar[dict] = {
        first: [(tag, rx) for tag, rx in resolvers if tag.endswith((":null", ":merge"))]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


def _read_file(path: Path) -> _Layer:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} ({path.resolve()} is not a file)")
    try:
        with path.open(encoding="utf-8") as stream:  # YAML's messages then name the file
            loader = _Loader(stream)
            node = loader.get_single_node()
        lines = _key_lines(node, path) if node is not None else {}
        values = loader.construct_document(node) if node is not None else {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(
            f"{path}, line {node.start_mark.line + 1}: a config file must be a mapping of keys "
            f"(key: value lines), not a {type(values).__name__}"
        )
    return _Layer(str(path), values, lines)


def _key_lines(node: yaml.Node, path: Path, prefix: str = "") -> dict[str, int]:
    """Dotted key -> line for every key of a YAML mapping node; a key set twice is an error."""
    lines: dict[str, int] = {}
    for key_node, value_node in node.value if isinstance(node, yaml.MappingNode) else ():
        key, line = _dotted(prefix, key_node.value), key_node.start_mark.line + 1
        if key_node.value == "<<":  # a merge: its keys are checked, without a line of their own
            continue
        if key in lines:
            raise ConfigError(
                f"{path}, line {line}: {key} is set twice (first on line {lines[key]}); keep one",
                key=key,
            )
        lines[key] = line
        lines.update(_key_lines(value_node, path, key))
    return lines


def _read_items(items: Sequence[str], source: str) -> list[_Layer]:
    """One layer per `key=value` item; the value is YAML (`x=` and `x=null` are None)."""
    layers = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            hint = f" (did you mean {item.lstrip('-')}=...?)" if item.startswith("-") else ""
            raise ConfigError(f"{source}: expected key=value, got {item!r}{hint}")
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"{source} ({item}): the value is not valid YAML: {_first_line(e)}", key=key
            ) from None
        for part in reversed(key.strip().split(".")):
            value = {part: value}
        layers.append(_Layer(f"{source} ({item})", value))
    return layers


# --- the command line and --help ----------------------------------------------------------------


def parse_cli(
    cls: type[T],
    argv: Sequence[str],
    default_config: str | Path | None,
    *,
    prog: str | None = None,
) -> T:
    """The config of an trainer: `[--config PATH] [key=value ...]`, or `-h/--help`.

    `--config PATH` replaces `default_config`; a relative PATH is looked up in the current
    directory, then next to `default_config`, then in the shipped configs' folder of the same
    name, so `--config llama3-8b.yaml` finds a recipe beside the kind's demo.yaml (and
    `configs/KIND/NAME.yaml`, a checkout's path, finds the shipped file where there is none). `--help` prints every key with its type, value and meaning, and exits 0.
    A bad config prints the error and exits 2, as argparse does, so the user sees one line rather
    than a traceback.
    """
    prog = prog or Path(sys.argv[0]).name
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [--config PATH] [key=value ...]",
        add_help=False,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="PATH")
    parser.add_argument("-h", "--help", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    try:
        path = default_config
        if args.config is not None:
            path = Path(args.config).expanduser()
            kind_folder = Path(default_config or ".").parent
            # beside the default, then among the shipped recipes of the same kind (where
            # SPECDRAFT_CONFIGS names a folder of defaults only), then a checkout's
            # configs/KIND/NAME.yaml among the shipped ones (an installed wheel has no checkout)
            shipped = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) else None
            for beside in (
                kind_folder / path,
                SHIPPED_CONFIGS / kind_folder.name / path,
                *([SHIPPED_CONFIGS / shipped] if shipped else []),
            ):
                if not path.exists() and not path.is_absolute() and beside.exists():
                    path = beside
        if args.help:
            print(format_help(cls, path, overrides, prog=prog))
            raise SystemExit(0)
        return load_config(cls, path, overrides)
    except ConfigError as e:
        print(f"{prog}: error: {e}\n(run {prog} --help to list every key)", file=sys.stderr)
        raise SystemExit(2) from None


def format_help(
    cls: type,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    prog: str = "train",
) -> str:
    """The `--help` text: usage, then every key (dotted) with its type, value and comment.

    Values are those the run would use (defaults, the file at `path`, `overrides`); if those do
    not load, the dataclass defaults are shown with the reason.
    """
    try:
        values = load_config(cls, path, overrides)
        source = f"values from {path}" if path is not None else "default values"
        if overrides:
            source += " and the command line"
    except ConfigError as e:
        values = cls()
        source = f"dataclass defaults; the config did not load: {e}"
    lines = [
        f"usage: {prog} [--config PATH] [key=value ...]",
        "",
        "Keys are set in the YAML file or as key=value (dotted for sections: data.max_length=256;",
        "values are YAML: lr=3e-4, tags=[a,b], resume_from=null).",
        "",
        f"Keys ({source}):",
    ]
    for key, tp, value, f, comment in _describe(values, prefix=""):
        line = f"  {key:<24} {_type_name(tp):<12} {'null' if value is None else value}"
        if "choices" in f.metadata:
            line += f"   ({' | '.join(f.metadata['choices'])})"
        lines.append(line)
        lines += textwrap.wrap(comment, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def _describe(obj: Any, prefix: str) -> list[tuple[str, Any, Any, dataclasses.Field, str]]:
    """(dotted key, type, value, field, comment) for every leaf key of `obj`, in field order."""
    comments, hints = _field_comments(type(obj)), typing.get_type_hints(type(obj))
    rows = []
    for f in dataclasses.fields(obj):
        key, value = _dotted(prefix, f.name), getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows += _describe(value, key)
        else:
            rows.append((key, hints[f.name], value, f, comments.get(f.name, "")))
    return rows


def _field_comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field in the class source: the fields' documentation.

    Read from the source so the comments stay the one description of a key; a class whose
    source is unavailable (e.g. defined in a REPL) simply has no descriptions in --help.
    """
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's comment wins
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        own, above, seen = {f.name for f in dataclasses.fields(klass)}, [], set()
        for line in source.splitlines():
            text = line.strip()
            if text.startswith("#"):
                above.append(text.lstrip("#").strip())
                continue
            name = re.match(r"(\w+)\s*:", text)
            if name and name[1] in own and name[1] not in seen:
                seen.add(name[1])
                comments[name[1]] = " ".join(above)
            above = []
    return comments


# --- writing ------------------------------------------------------------------------------------


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved `cfg` as YAML to `path` (atomically) and return the path.

    `load_config(type(cfg), path)` gives back an equal object.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = getattr(cfg, "kind", None)
    header = (
        f"# Resolved specdraft {kind + ' ' if kind else ''}training config "
        f"({type(cfg).__name__}): defaults + file + command line.\n"
    )
    body = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True, width=100)
    # Write then rename, so a crash never leaves a half-written config beside a checkpoint.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(header + body, encoding="utf-8")
    os.replace(tmp, path)
    return path


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts and lists (for YAML, JSON, W&B or checkpoint metadata)."""
    return dataclasses.asdict(cfg)


# --- small helpers ------------------------------------------------------------------------------


def _field_type(cls: type, key: str) -> Any:
    """The annotated type of dotted `key` in dataclass `cls` ("" is `cls` itself)."""
    tp: Any = cls
    for part in filter(None, key.split(".")):
        tp = typing.get_type_hints(tp).get(part) if dataclasses.is_dataclass(tp) else None
    return tp


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("None", "null")


def _dotted(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
