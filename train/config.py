"""Typed training configs: dataclasses, YAML files and key=value overrides (DESIGN.md, "Config").

A run's config is built in three layers, each later one winning:

1. the dataclass defaults (`TrainConfig`, or a drafter kind's subclass of it),
2. a YAML file (`configs/<kind>/demo.yaml` or a recipe),
3. `key=value` overrides from the command line, dotted for nesting (`data.max_length=256`).

Every layer is checked against the dataclasses: an unknown key, a value of the wrong type or a
value outside a field's choices is a `ConfigError` that names the key, where it came from (the
file and line, or the command line) and what to do instead. The resolved config is written with
`save_config` next to what it produced and loads back to an equal object.

Values are read as YAML 1.2 scalars, not PyYAML's YAML 1.1: `3e-4` is a float, `no` and `on` are
strings (so `mixed_precision: no` means what it says), `010` is ten. A field typed `str` keeps
the text exactly as written (`run_name=1e3` is "1e3"), with `null` / `~` meaning None.
"""

import ast
import dataclasses
import difflib
import inspect
import os
import re
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from specdraft.data.config import DataConfig, choice

# The resolved config of a run, in output_dir and in every checkpoint folder.
CONFIG_FILENAME = "train_config.yaml"

T = TypeVar("T")

_NULL_TAG = "tag:yaml.org,2002:null"


class ConfigError(ValueError):
    """A config that cannot be built. The message names the key, where it was set and what to do.

    `key` is the dotted key at fault (None when the problem is the file as a whole).
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass
class LoopEvalConfig:
    """After training: the saved drafter measured in the inference loop against plain decoding
    (inference/measure.py), written to output_dir/eval_loop.json beside the simulated tau."""

    # Run the measurement at the end of training (it decodes every prompt twice).
    enabled: bool = True
    # auto: the demo's held-out prompts when data.path is demo, else the prompt part of the
    # held-out split; or demo | eval | a .txt/.json/.jsonl file of prompts.
    prompts: str = "auto"
    # Prompts decoded, by each of the drafter and plain decoding.
    num_prompts: int = 8
    # New tokens per prompt (fewer if EOS comes first).
    max_new_tokens: int = 128
    # 0 is greedy (output must equal plain decoding's); above 0, seeded lossless sampling.
    temperature: float = 0.0
    # CPU threads for the measurement; 0: every core this process may use, as decoding would.
    # (`accelerate launch` pins a lone CPU process to 1 thread for training; decoding speedups
    # differ by thread count, so the measurement states the count it ran with.)
    threads: int = 0

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ConfigError(
                f"eval_loop.threads must be >= 0 (0: all cores); got {self.threads}",
                key="eval_loop.threads",
            )
        for key in ("num_prompts", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(
                    f"eval_loop.{key} must be >= 1; got {getattr(self, key)}",
                    key=f"eval_loop.{key}",
                )
        if self.temperature < 0:
            raise ConfigError("eval_loop.temperature must be >= 0", key="eval_loop.temperature")


@dataclass
class TrainConfig:
    """The keys every drafter kind shares (DESIGN.md, "Common config keys and outputs").

    A drafter kind subclasses it, names its kind and adds its own section:

        @dataclass
        class EagleTrainConfig(TrainConfig):
            kind: ClassVar[str] = "eagle"
            drafter: EagleConfig = field(default_factory=EagleConfig)

    Building one (directly, or through `load_config`) validates choices and ranges and resolves
    the defaults that depend on other keys (`output_dir`, `run_name`).
    """

    # The drafter kind this config trains. A class attribute, not a key: a file cannot make the
    # eagle script train something else, and the kind picks the default output_dir.
    kind: ClassVar[str] = "base"

    # The target model: "demo" (the small model built on first use), a local folder or a hub id.
    target: str = "demo"
    # dtype the frozen target is loaded in; auto follows mixed_precision (bf16 -> bfloat16,
    # fp16 -> float16, no -> float32) so CPU runs stay fp32 and GPU runs need one key.
    dtype: str = choice("auto", "float32", "bfloat16", "float16")
    # Training data: source, conversation format, lengths and the held-out split.
    data: DataConfig = field(default_factory=DataConfig)
    # Where checkpoint-<step>/, best/, final/ and train_config.yaml go; None: runs/<kind>-demo.
    output_dir: str | None = None
    # Length of the run in optimizer steps (one step = grad_accum micro-batches).
    max_steps: int = 2000
    # Sequences per device per forward pass; lower it first when memory runs out.
    micro_batch_size: int = 8
    # Micro-batches per optimizer step: effective batch = micro_batch_size * grad_accum * devices.
    grad_accum: int = 1
    # Peak learning rate (AdamW), reached at the end of warmup.
    lr: float = 3e-4
    # AdamW decoupled weight decay; 0 leaves the weights unregularized.
    weight_decay: float = 0.0
    # AdamW first-moment coefficient.
    adam_beta1: float = 0.9
    # AdamW second-moment coefficient; below the usual 0.999 so short runs adapt faster.
    adam_beta2: float = 0.95
    # Steps of linear warmup from 0 to lr, before the schedule below starts.
    warmup_steps: int = 100
    # Decay after warmup, a pure function of the step: cosine | linear | constant.
    lr_schedule: str = choice("cosine", "linear", "constant")
    # Floor of the decay as a fraction of lr (cosine and linear end at lr * min_lr_ratio).
    min_lr_ratio: float = 0.1
    # Clip the global gradient norm to this; 0 disables clipping.
    max_grad_norm: float = 1.0
    # Seeds model init, data order and dropout; the same seed reproduces a run.
    seed: int = 0
    # Steps between loss/lr lines on the console and the tracker.
    log_every: int = 10
    # Steps between evaluations on the held-out split (loss and simulated tau); 0 disables.
    eval_every: int = 500
    # Held-out micro-batches per process per evaluation (the same examples for any process count);
    # 0 uses the whole held-out split.
    eval_batches: int = 50
    # Steps between resumable checkpoint-<step>/ folders; 0 saves only best/ and final/.
    save_every: int = 500
    # checkpoint-<step>/ folders kept, oldest deleted first (best/ and final/ stay); 0 keeps all.
    keep_last: int = 2
    # Experiment tracker: none | wandb | tensorboard (console progress is always on).
    report_to: str = choice("none", "wandb", "tensorboard")
    # W&B project the run is logged to (report_to=wandb only).
    wandb_project: str = "specdraft"
    # Name of the run in the tracker; None: the name of output_dir.
    run_name: str | None = None
    # Free-form labels for the tracker, e.g. tags=[demo,ablation].
    tags: list[str] = field(default_factory=list)
    # None: start fresh; "latest": the newest complete checkpoint in output_dir; or a
    # checkpoint-<step> folder.
    resume_from: str | None = None
    # Autocast precision of training (accelerate's values): no | bf16 | fp16.
    mixed_precision: str = choice("no", "bf16", "fp16")
    # Threads per process when training on a CPU; 0: OMP_NUM_THREADS where you set it for a plain
    # `python` run, else the physical cores this process may use divided by the processes on this
    # machine (what `accelerate launch --cpu` picks). Plain `accelerate launch` on a machine
    # without a GPU gives every process OMP_NUM_THREADS=1, which on the demo's 2 cores trains at
    # 0.57x the speed (BENCHMARKS.md, "EAGLE"); under accelerate, set cpu_threads to choose.
    cpu_threads: int = 0
    # After training: the saved drafter's measured tau and speedup in the inference loop.
    eval_loop: LoopEvalConfig = field(default_factory=LoopEvalConfig)

    def target_dtype(self) -> str:
        """The dtype the target loads in: `dtype`, or for auto the one mixed_precision implies."""
        if self.dtype != "auto":
            return self.dtype
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.mixed_precision, "float32")

    def __post_init__(self) -> None:
        # OmegaConf.to_object calls this too, so files, overrides and code are held to one standard.
        check_choices(self, prefix="")
        for key, low in (
            ("max_steps", 1),
            ("micro_batch_size", 1),
            ("grad_accum", 1),
            ("weight_decay", 0),
            ("warmup_steps", 0),
            ("max_grad_norm", 0),
            ("log_every", 1),
            ("eval_every", 0),
            ("eval_batches", 0),
            ("save_every", 0),
            ("keep_last", 0),
            ("cpu_threads", 0),
        ):
            if getattr(self, key) < low:
                raise ConfigError(f"{key} must be >= {low}; got {getattr(self, key)}", key=key)
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0; got {self.lr}", key="lr")
        for key in ("min_lr_ratio", "adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"{key} must be in [0, 1]; got {getattr(self, key)}", key=key)
        if self.output_dir is None:
            self.output_dir = f"runs/{self.kind}-demo"
        if self.run_name is None:
            self.run_name = Path(self.output_dir).name


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Build a `cls` from its defaults, the YAML file at `path` (None: none) and `overrides`.

    Overrides are `key=value` strings, dotted for nesting (`data.max_length=256`); values are YAML
    (`lr=3e-4`, `tags=[a,b]`, `resume_from=null`). A key set in the file keeps its siblings'
    defaults: `data: {max_length: 256}` changes one key of `data`, not the whole section.
    Raises ConfigError naming the key and the file (with its line) or the command line.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config needs a dataclass type, got {cls!r}")
    layers: list[_Layer] = []
    if path is not None:
        layers.append(_read_file(cls, Path(path)))
    layers.extend(_read_override(cls, item) for item in overrides)

    merged = OmegaConf.structured(cls)
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer.values)
        except OmegaConfBaseException as e:
            raise _type_error(cls, layer, e) from None
    try:
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        # Interpolations (${...}) resolve here; the rest was checked while merging.
        raise ConfigError(f"cannot resolve the config: {_first_line(e)}") from None
    except ValueError as e:
        # Raised by a __post_init__, which cannot know where the value came from: the last layer
        # that set the key did. A section's own __post_init__ (a drafter config) names its key
        # relative to the section, so a key ending in it counts too.
        key = e.key if isinstance(e, ConfigError) else None
        exact = [(layer, key) for layer in layers if key and key in layer.dotted_keys()]
        inner = [
            (layer, k)
            for layer in layers
            if key
            for k in layer.dotted_keys()
            if k.endswith("." + key)
        ]
        if exact or inner:
            layer, key = (exact or inner)[-1]
            raise ConfigError(f"{layer.where(key)}: {e}", key=key) from None
        sources = ", ".join([f"the defaults of {cls.__name__}"] + [x.source for x in layers])
        raise ConfigError(f"config built from {sources}: {e}", key=key) from None


def parse_cli(
    cls: type[T],
    argv: Sequence[str],
    default_config: str | Path | None,
    *,
    prog: str | None = None,
) -> T:
    """The config of an entry script: `[--config PATH] [key=value ...]`, or `-h/--help`.

    `--config PATH` (also `--config=PATH` or `config=PATH`) replaces `default_config`; a relative
    PATH is looked up in the current directory, then next to `default_config`, so
    `--config llama3-8b.yaml` finds a recipe beside the kind's demo.yaml. `--help` prints every
    key with its type, value and meaning, and exits 0. A bad config prints the error and exits 2,
    as argparse does, so the user sees one line rather than a traceback.
    """
    prog = prog or Path(sys.argv[0]).name
    try:
        config_path, overrides, want_help = _split_argv(argv)
        path = _find_config(config_path, default_config) if config_path else default_config
        if want_help:
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
    for key, type_name, value, choices, comment in _describe(values, prefix=""):
        shown = "null" if value is None else value
        line = f"  {key:<24} {type_name:<12} {shown}"
        if choices:
            line += f"   ({' | '.join(choices)})"
        lines.append(line)
        if comment:
            lines.extend(
                textwrap.wrap(comment, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6)
            )
    return "\n".join(lines)


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
    body = yaml.dump(
        config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100
    )
    # Write then rename, so a crash never leaves a half-written config beside a checkpoint.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(header + body, encoding="utf-8")
    os.replace(tmp, path)
    return path


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts and lists (for YAML, JSON, W&B or checkpoint metadata)."""
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"config_to_dict needs a dataclass instance, got {cfg!r}")
    return dataclasses.asdict(cfg)


# --- YAML: one dialect (YAML 1.2 core scalars) for reading files, overrides and for writing ---

_INT_RE = re.compile(r"^[-+]?[0-9]+$")
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


def _yaml12(base: type) -> type:
    """A PyYAML Loader/Dumper class that resolves bool, int and float as YAML 1.2 does.

    PyYAML follows YAML 1.1, where `3e-4` is a string, `no` is False, `010` is 8 and dates
    become datetime objects; none of that is what a config author means. Int and float are
    resolved in that order, so `10` is an int and `1e1` a float.
    """
    replaced = {"bool", "int", "float", "timestamp"}
    cls = type(f"_YAML12{base.__name__}", (base,), {})
    cls.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag.rsplit(":", 1)[-1] not in replaced]
        for first, resolvers in base.yaml_implicit_resolvers.items()
    }
    cls.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_RE, list("tTfF"))
    cls.add_implicit_resolver("tag:yaml.org,2002:int", _INT_RE, list("-+0123456789"))
    cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))
    if hasattr(cls, "add_constructor"):
        # Decimal always: PyYAML's own int constructor reads a leading 0 as octal.
        cls.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(node.value))
    return cls


_Loader = _yaml12(yaml.SafeLoader)
# The dumper shares the resolvers, so a string that would read back as a number gets quoted.
_Dumper = _yaml12(yaml.SafeDumper)


@dataclass
class _Layer:
    """One source of values: a file or one command-line item, as nested dicts of checked keys."""

    source: str  # the file path, or "command line (item)"
    values: dict[str, Any]
    lines: dict[str, int]  # dotted key -> line in the file (files only)

    def where(self, key: str | None) -> str:
        line = self.lines.get(key or "")
        return f"{self.source}, line {line}" if line else self.source

    def dotted_keys(self) -> list[str]:
        """Every dotted key this layer sets, sections included."""
        return _dotted_keys(self.values, "")


def _dotted_keys(values: dict[str, Any], prefix: str) -> list[str]:
    keys = []
    for name, value in values.items():
        keys.append(_dotted(prefix, name))
        if isinstance(value, dict):
            keys.extend(_dotted_keys(value, _dotted(prefix, name)))
    return keys


def _read_file(cls: type, path: Path) -> _Layer:
    if not path.exists():
        relative = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"config file not found: {path}{relative}")
    if not path.is_file():
        raise ConfigError(f"config path is not a file: {path}; give a .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not a UTF-8 text file ({e.reason}); give a YAML file"
        ) from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    layer = _Layer(source=str(path), values={}, lines={})
    if node is None:  # an empty file sets nothing
        return layer
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(
            f"{path}, line {node.start_mark.line + 1}: a config file must be a mapping of keys "
            f"(key: value lines), not a {_node_kind(node)}"
        )
    layer.values = _construct_section(cls, node, loader, prefix="", layer=layer)
    loader.dispose()
    return layer


def _read_override(cls: type, item: str) -> _Layer:
    layer = _Layer(source=f"command line ({item})", values={}, lines={})
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        hint = f" (did you mean {item.lstrip('-')}=...?)" if item.startswith("-") else ""
        raise ConfigError(f"command line: expected key=value, got {item!r}{hint}")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as e:
        raise ConfigError(f"{layer.source}: the value is not valid YAML: {e}", key=key) from None
    if node is None:  # `key=` : YAML reads an empty value as null
        node = yaml.ScalarNode(_NULL_TAG, "")

    # Walk the dotted key down the sections, then read the value against the last field.
    parts = key.split(".")
    section: type = cls
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        _field_or_error(section, part, prefix, layer)
        field_type = _field_types(section)[part]
        if depth < len(parts) - 1:
            if not _is_section(field_type):
                raise ConfigError(
                    f"{layer.source}: {_dotted(prefix, part)} is a value, not a section; "
                    f"set it as {_dotted(prefix, part)}=...",
                    key=_dotted(prefix, part),
                )
            section = field_type
    value = _construct_value(field_type, node, loader, key, layer)
    loader.dispose()
    for part in reversed(parts):
        value = {part: value}
    layer.values = value
    return layer


def _construct_section(
    cls: type, node: yaml.MappingNode, loader: Any, prefix: str, layer: _Layer
) -> dict[str, Any]:
    """Check a YAML mapping against the dataclass `cls` and build its values, key by key."""
    loader.flatten_mapping(node)  # apply `<<: *anchor` merges before the keys are checked
    types_ = _field_types(cls)
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        name = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
        key = _dotted(prefix, name)
        if name in out:
            raise ConfigError(
                f"{layer.source}, line {line}: {key} is set twice (first on line "
                f"{layer.lines[key]}); keep one",
                key=key,
            )
        layer.lines[key] = line
        _field_or_error(cls, name, prefix, layer)
        out[name] = _construct_value(types_[name], value_node, loader, key, layer)
    return out


def _construct_value(tp: Any, node: yaml.Node, loader: Any, key: str, layer: _Layer) -> Any:
    """The Python value of `node` for a field of type `tp` (type errors are left to OmegaConf)."""
    if _is_section(tp):
        if not isinstance(node, yaml.MappingNode):
            example = dataclasses.fields(tp)[0].name
            raise ConfigError(
                f"{layer.where(key)}: {key} is a section, not a value; set its keys "
                f"({key}.{example}=...) or give it a mapping",
                key=key,
            )
        return _construct_section(tp, node, loader, prefix=key, layer=layer)
    base = _strip_optional(tp)
    if base is str and isinstance(node, yaml.ScalarNode):
        # Keep the text as written: a run_name of 1e3 or a target of 007 is not a number.
        return None if node.tag == _NULL_TAG else node.value
    is_str_list = typing.get_origin(base) is list and typing.get_args(base) == (str,)
    if is_str_list and isinstance(node, yaml.SequenceNode):
        return [_construct_value(str, item, loader, key, layer) for item in node.value]
    try:
        return loader.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError) as e:
        # E.g. a python/object tag: the safe loader builds plain data only.
        raise ConfigError(
            f"{layer.where(key)}: cannot read the value of {key}: {_first_line(e)}", key=key
        ) from None


def _field_or_error(cls: type, name: str, prefix: str, layer: _Layer) -> dataclasses.Field:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name in fields:
        return fields[name]
    key = _dotted(prefix, name)
    section = f"section {prefix!r}" if prefix else "the top level of the config"
    close = difflib.get_close_matches(str(name), list(fields), n=3, cutoff=0.6)
    if close:
        todo = "did you mean " + " or ".join(repr(_dotted(prefix, c)) for c in close) + "?"
    else:
        todo = "valid keys there: " + ", ".join(fields)
    raise ConfigError(f"{layer.where(key)}: unknown key {key!r} in {section}; {todo}", key=key)


def _type_error(cls: type, layer: _Layer, e: OmegaConfBaseException) -> ConfigError:
    """Reword OmegaConf's failed conversion as: where, which key, what it expects, what it got."""
    key = getattr(e, "full_key", None) or None
    if key is None:
        return ConfigError(f"{layer.source}: {_first_line(e)}")
    value: Any = layer.values
    section: type = cls
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
        tp = _field_types(section).get(part) if _is_section(section) else None
        section = tp
    expected = _type_name(tp) if tp is not None else "another type"
    return ConfigError(
        f"{layer.where(key)}: {key} expects {expected}; got {value!r}"
        + (" (write lists as [a,b])" if typing.get_origin(tp) is list else ""),
        key=key,
    )


def check_choices(obj: Any, prefix: str) -> None:
    """Check every field with choices in `obj` and its nested sections (drafter sections too)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = _dotted(prefix, f.name)
        if dataclasses.is_dataclass(value):
            check_choices(value, key)
            continue
        choices = _choices(type(obj), f)
        if choices and value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of: {' | '.join(choices)}", key=key)


def _choices(cls: type, f: dataclasses.Field) -> tuple[str, ...] | None:
    if "choices" in f.metadata:
        return tuple(f.metadata["choices"])
    return None


def _describe(obj: Any, prefix: str) -> list[tuple[str, str, Any, tuple[str, ...] | None, str]]:
    """(dotted key, type, value, choices, comment) for every leaf key of `obj`, in field order."""
    comments = _field_comments(type(obj))
    types_ = _field_types(type(obj))
    rows = []
    for f in dataclasses.fields(obj):
        key = _dotted(prefix, f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(_describe(value, key))
        else:
            rows.append(
                (
                    key,
                    _type_name(types_[f.name]),
                    value,
                    _choices(type(obj), f),
                    comments.get(f.name, ""),
                )
            )
    return rows


def _field_comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field in the class source: the fields' documentation.

    Read from the source so the comments stay the one description of a key; a class whose
    source is unavailable (e.g. defined in a REPL) simply has no descriptions in --help.
    """
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = textwrap.dedent(inspect.getsource(klass)).splitlines()
        except (OSError, TypeError):
            continue
        class_def = ast.parse("\n".join(lines)).body[0]
        own = {f.name for f in dataclasses.fields(klass)}
        for stmt in getattr(class_def, "body", []):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if stmt.target.id not in own:
                continue
            above: list[str] = []
            i = stmt.lineno - 2  # lineno is 1-based; start at the line before the field
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            comments[stmt.target.id] = " ".join(above)
    return comments


def _split_argv(argv: Sequence[str]) -> tuple[str | None, list[str], bool]:
    """(--config path or None, key=value overrides, whether help was asked for)."""
    config: str | None = None
    overrides: list[str] = []
    want_help = False
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        value: str | None = None
        if item in ("-h", "--help"):
            want_help = True
        elif item == "--config":
            if i + 1 >= len(items):
                raise ConfigError("command line: --config needs a path (--config PATH)")
            value = items[i + 1]
            i += 1
        elif item.startswith(("--config=", "config=")):
            value = item.split("=", 1)[1]
        else:
            overrides.append(item)
        if value is not None:
            if config is not None:
                raise ConfigError(
                    f"command line: --config given twice ({config} and {value}); give one file "
                    "and set single keys as key=value"
                )
            config = value
        i += 1
    return config, overrides, want_help


def _find_config(path: str, default_config: str | Path | None) -> Path:
    """`path` as given (relative to the current directory), else beside the default config."""
    given = Path(path).expanduser()
    tried = [given]
    if given.exists() or given.is_absolute() or default_config is None:
        return given
    beside = Path(default_config).parent / given
    tried.append(beside)
    if beside.exists():
        return beside
    raise ConfigError(
        "config file not found: "
        + " nor ".join(str(p) for p in tried)
        + f" (current directory: {Path.cwd()})"
    )


def _field_types(cls: type) -> dict[str, Any]:
    # get_type_hints resolves string annotations (data/config.py uses `from __future__ import
    # annotations`) and includes inherited fields.
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _node_kind(node: yaml.Node) -> str:
    return "list" if isinstance(node, yaml.SequenceNode) else "single value"


def _dotted(prefix: str, name: Any) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
