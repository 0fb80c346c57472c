"""The typed config: defaults, file and command-line layers, strictness, round trip, subclassing,
--help, and `override` on an existing config object."""

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from specdraft.config import (
    ConfigError,
    choice,
    config_to_dict,
    format_help,
    load_config,
    override,
    parse_cli,
    save_config,
)
from specdraft.data.data_config import DataConfig
from specdraft.train.train_config import CONFIG_FILENAME, TrainConfig


@dataclass
class DummyDrafterConfig:
    # Draft tokens per step.
    depth: int = 4
    # How the dummy drafter mixes features.
    mode: str = choice("sum", "concat")
    widths: list[int] = field(default_factory=lambda: [8, 16])


@dataclass
class CheckedDrafterConfig:
    # A drafter config that validates itself, as a kind's own __post_init__ may.
    heads: int = 2

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise ConfigError(f"heads must be >= 1; got {self.heads}", key="heads")


@dataclass
class CheckedTrainConfig(TrainConfig):
    kind: ClassVar[str] = "checked"
    drafter: CheckedDrafterConfig = field(default_factory=CheckedDrafterConfig)


@dataclass
class DummyTrainConfig(TrainConfig):
    """The pattern every drafter kind follows: a kind name and a nested drafter section."""

    kind: ClassVar[str] = "dummy"
    drafter: DummyDrafterConfig = field(default_factory=DummyDrafterConfig)


def leaf_keys(cls, prefix=""):
    """Every dotted key of a config dataclass that holds a value (sections are walked into)."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            yield from leaf_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_file_or_overrides():
    cfg = load_config(TrainConfig, None)
    assert cfg == TrainConfig()
    assert cfg.target == "demo"
    assert cfg.data == DataConfig()
    assert cfg.output_dir == "runs/base-demo"
    assert cfg.run_name == "base-demo"
    assert cfg.report_to == "none" and cfg.lr_schedule == "cosine"
    assert cfg.resume_from is None and cfg.tags == []


def test_file_then_overrides_precedence(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        "lr: 1e-3\nmax_steps: 50\nreport_to: wandb\ndata:\n  max_length: 128\n",
    )
    cfg = load_config(TrainConfig, path, ["lr=3e-4", "data.split=test"])
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)  # the command line wins over the file
    assert cfg.max_steps == 50 and cfg.report_to == "wandb"  # the file wins over the defaults
    assert cfg.data.max_length == 128 and cfg.data.split == "test"
    # Setting one key of a section keeps the section's other defaults.
    assert cfg.data.path == DataConfig().path
    assert cfg.micro_batch_size == TrainConfig().micro_batch_size
    # Later overrides win over earlier ones.
    assert load_config(TrainConfig, path, ["max_steps=7", "max_steps=9"]).max_steps == 9


def test_scalars_mean_what_the_field_type_says(tmp_path):
    # PyYAML's YAML 1.1 reads 3e-4 as a string, `no` as False and 010 as 8; here the text goes
    # to OmegaConf, which converts it to the field's type.
    path = write(tmp_path / "c.yaml", "lr: 3e-4\nmixed_precision: no\nrun_name: 1e3\nseed: 010\n")
    cfg = load_config(TrainConfig, path, ["min_lr_ratio=5E-2", "target=007", "tags=[a, 2, yes]"])
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)
    assert cfg.min_lr_ratio == 0.05
    assert cfg.mixed_precision == "no"
    assert cfg.seed == 10
    # str fields keep the text as written rather than a number's repr.
    assert cfg.run_name == "1e3" and cfg.target == "007" and cfg.tags == ["a", "2", "yes"]


def test_null_and_lists_on_command_line(tmp_path):
    path = write(tmp_path / "c.yaml", "resume_from: latest\ntags: [x]\ndata:\n  max_samples: 9\n")
    cfg = load_config(
        TrainConfig,
        path,
        ["resume_from=null", "tags=[a,b]", "data.max_samples=~", "run_name='null'"],
    )
    assert cfg.resume_from is None and cfg.data.max_samples is None
    assert cfg.tags == ["a", "b"]  # a list replaces the file's list
    assert cfg.run_name == "null"  # quoted: the string, not None


def test_nested_dotted_overrides():
    cfg = load_config(
        DummyTrainConfig, None, ["data.max_length=256", "drafter.depth=6", "drafter.widths=[1,2,3]"]
    )
    assert cfg.data.max_length == 256
    assert cfg.drafter == DummyDrafterConfig(depth=6, widths=[1, 2, 3])


def test_unknown_key_in_file_names_key_file_line_and_suggestion(tmp_path):
    path = write(tmp_path / "recipe.yaml", "lr: 1e-3\n\nmax_step: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path)
    msg = str(err.value)
    assert "max_step" in msg and str(path) in msg and "line 3" in msg
    assert "did you mean 'max_steps'" in msg
    assert err.value.key == "max_step"


def test_unknown_nested_key_in_file(tmp_path):
    path = write(tmp_path / "recipe.yaml", "data:\n  path: demo\n  max_lenght: 5\n")
    with pytest.raises(ConfigError, match=r"line 3.*'data\.max_lenght'.*'data\.max_length'"):
        load_config(TrainConfig, path)


def test_unknown_key_on_command_line():
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, ["lrr=1e-3"])
    msg = str(err.value)
    assert "command line" in msg and "lrr" in msg and "did you mean 'lr'" in msg
    # Without a close match, the valid keys of that section are listed.
    with pytest.raises(
        ConfigError, match=r"'drafter\.zzz'.*valid keys in drafter: depth, mode, wid"
    ):
        load_config(DummyTrainConfig, None, ["drafter.zzz=1"])


def test_wrong_type_names_key_value_and_source(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, ["max_steps=abc"])
    msg = str(err.value)
    assert "command line (max_steps=abc)" in msg and "max_steps expects int" in msg
    assert "'abc'" in msg and err.value.key == "max_steps"

    path = write(tmp_path / "c.yaml", "seed: 1\ndata:\n  max_length: long\n")
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path)
    msg = str(err.value)
    assert str(path) in msg and "line 3" in msg and "data.max_length expects int" in msg
    assert err.value.key == "data.max_length"

    with pytest.raises(ConfigError, match=r"max_steps expects int; got '2\.5'"):
        load_config(TrainConfig, None, ["max_steps=2.5"])
    with pytest.raises(ConfigError, match=r"tags expects list\[str\].*\[a,b\]"):
        load_config(TrainConfig, None, ["tags=a"])


def test_section_and_value_confusion(tmp_path):
    with pytest.raises(ConfigError, match=r"\(data=foo\): data expects a section of keys \(data\."):
        load_config(TrainConfig, None, ["data=foo"])
    path = write(tmp_path / "c.yaml", "seed: 1\ndata: foo\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}, line 2: data expects a sect"):
        load_config(TrainConfig, path)
    with pytest.raises(ConfigError, match=r"\(lr\.peak=1\): lr expects float"):
        load_config(TrainConfig, None, ["lr.peak=1"])


@pytest.mark.parametrize(
    ("text", "item", "key", "says"),
    [
        ("data:\n  max_lenght: 5\n", "data.max_lenght=5", "data.max_lenght", "unknown key"),
        ("data:\n  max_length: long\n", "data.max_length=long", "data.max_length", "expects int"),
        ("data:\n  overlong: cut\n", "data.overlong=cut", "data.overlong", "truncate | drop"),
    ],
    ids=["unknown-key", "wrong-type", "bad-choice"],
)
def test_named_errors_from_a_file_and_from_the_command_line(tmp_path, text, item, key, says):
    # The bar: each kind of mistake names the key and where it was made, both ways.
    path = write(tmp_path / "recipe.yaml", "seed: 1\n" + text)
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path)
    assert str(err.value).startswith(f"{path}, line 3: ") and says in str(err.value)
    assert key in str(err.value) and err.value.key == key
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, ["seed=1", item])
    assert str(err.value).startswith(f"command line ({item}): ") and says in str(err.value)
    assert key in str(err.value) and err.value.key == key


@pytest.mark.parametrize(
    ("item", "key", "allowed"),
    [
        ("report_to=wandbb", "report_to", "none | wandb | tensorboard"),
        ("lr_schedule=step", "lr_schedule", "cosine | linear | constant"),
        ("mixed_precision=fp8", "mixed_precision", "auto | no | bf16 | fp16"),
        ("data.overlong=cut", "data.overlong", "truncate | drop"),
        ("data.format=csv", "data.format", "sharegpt"),
        ("drafter.mode=max", "drafter.mode", "sum | concat"),
    ],
)
def test_bad_choice_names_key_value_and_allowed(item, key, allowed):
    with pytest.raises(ConfigError) as err:
        load_config(DummyTrainConfig, None, [item])
    msg = str(err.value)
    bad = item.split("=", 1)[1]
    assert f"command line ({item})" in msg and f"{key}={bad!r}" in msg and allowed in msg
    assert err.value.key == key


def test_bad_choice_and_range_in_file_name_the_file(tmp_path):
    path = write(tmp_path / "c.yaml", "max_steps: 10\nreport_to: mlflow\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}, line 2: report_to='mlflow'"):
        load_config(TrainConfig, path)
    path = write(tmp_path / "d.yaml", "grad_accum: 0\n")
    with pytest.raises(
        ConfigError, match=rf"{re.escape(str(path))}, line 1: grad_accum must be >= 1"
    ):
        load_config(TrainConfig, path)
    # The command line overrides the file's bad value, so nothing is wrong any more.
    assert load_config(TrainConfig, path, ["grad_accum=2"]).grad_accum == 2


def test_drafter_section_validation_names_the_full_key_and_source(tmp_path):
    # The section's __post_init__ names its key relative to the section ("heads"); the error
    # still points at the file line or command-line item that set drafter.heads.
    path = write(tmp_path / "c.yaml", "seed: 1\ndrafter:\n  heads: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(CheckedTrainConfig, path)
    assert f"{path}, line 3: heads must be >= 1" in str(err.value)
    assert err.value.key == "drafter.heads"
    with pytest.raises(ConfigError, match=r"command line \(drafter\.heads=-1\): heads must be"):
        load_config(CheckedTrainConfig, path, ["drafter.heads=-1"])


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="lr_schedule='step'"):
        TrainConfig(lr_schedule="step")
    with pytest.raises(ConfigError, match="lr must be > 0"):
        TrainConfig(lr=0.0)


def test_bad_files_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*missing\.yaml"):
        load_config(TrainConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(TrainConfig, tmp_path)
    bad = write(tmp_path / "bad.yaml", "lr: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(bad))} is not valid YAML"):
        load_config(TrainConfig, bad)
    listed = write(tmp_path / "list.yaml", "- lr: 1\n")
    with pytest.raises(
        ConfigError, match=rf"{re.escape(str(listed))}, line 1: a config file must be a mapping"
    ):
        load_config(TrainConfig, listed)
    twice = write(tmp_path / "twice.yaml", "lr: 1\nseed: 2\nlr: 3\n")
    with pytest.raises(
        ConfigError, match=rf"{re.escape(str(twice))}, line 3: lr is set twice \(first on line 1\)"
    ):
        load_config(TrainConfig, twice)
    # The safe loader builds plain data only: a python tag is refused, naming the file.
    tagged = write(tmp_path / "tagged.yaml", "seed: 1\nmax_steps: !!python/object:os.getcwd {}\n")
    with pytest.raises(
        ConfigError, match=rf"(?s){re.escape(str(tagged))} is not valid YAML.*line 2"
    ):
        load_config(TrainConfig, tagged)
    # An empty file sets nothing.
    assert load_config(TrainConfig, write(tmp_path / "empty.yaml", "")) == TrainConfig()


def test_yaml_anchors_and_merge_keys(tmp_path):
    text = "common: &c\n  max_length: 64\n"
    path = write(tmp_path / "c.yaml", "data:\n  <<: {max_length: 64, split: dev}\n  seed: 3\n")
    cfg = load_config(TrainConfig, path)
    assert (cfg.data.max_length, cfg.data.split, cfg.data.seed) == (64, "dev", 3)
    # An anchor holder key is still an unknown key: nothing is silently ignored.
    with pytest.raises(ConfigError, match="unknown key 'common'"):
        load_config(TrainConfig, write(tmp_path / "d.yaml", text))


def test_round_trip_save_load_equal(tmp_path):
    cfg = load_config(
        DummyTrainConfig,
        None,
        [
            "lr=3e-4",
            "tags=[demo, 1e3]",
            "run_name=no",
            "resume_from=latest",
            "data.max_samples=100",
            "drafter.widths=[3]",
            "max_grad_norm=0.1",
            "report_to=tensorboard",
            "target=007",
            "data.name='null'",
            "eval_loop.enabled=false",
        ],
    )
    path = save_config(cfg, tmp_path / "run" / CONFIG_FILENAME)
    assert path.is_file() and not list(path.parent.glob(".*.tmp"))
    loaded = load_config(DummyTrainConfig, path)
    assert loaded == cfg
    assert config_to_dict(loaded) == config_to_dict(cfg)
    # The resolved defaults are written out, so the file alone reproduces the run.
    assert "output_dir: runs/dummy-demo" in path.read_text()


def test_config_to_dict_is_plain_nested_data():
    d = config_to_dict(DummyTrainConfig())
    assert d["data"] == dataclasses.asdict(DataConfig())
    assert d["drafter"] == {"depth": 4, "mode": "sum", "widths": [8, 16]}
    assert "kind" not in d  # a class attribute, not a key a file may set


def test_subclass_with_drafter_section():
    cfg = load_config(DummyTrainConfig, None, ["drafter.depth=2"])
    assert cfg.kind == "dummy" and DummyTrainConfig.kind == "dummy"
    assert cfg.output_dir == "runs/dummy-demo"
    assert isinstance(cfg.drafter, DummyDrafterConfig) and cfg.drafter.depth == 2
    # The common keys are still there and still validated.
    with pytest.raises(ConfigError, match="report_to"):
        load_config(DummyTrainConfig, None, ["report_to=x"])
    # The kind cannot be set from a file or the command line.
    with pytest.raises(ConfigError, match="unknown key 'kind'"):
        load_config(DummyTrainConfig, None, ["kind=eagle"])


def test_parse_cli_uses_default_config_and_overrides(tmp_path):
    default = write(tmp_path / "demo.yaml", "max_steps: 11\n")
    cfg = parse_cli(TrainConfig, ["lr=1e-2"], default_config=default)
    assert (cfg.max_steps, cfg.lr) == (11, 1e-2)


def test_default_configs_come_from_the_checkout_or_the_folder_specdraft_configs_names(
    tmp_path, monkeypatch
):
    """An entry script's default config is configs/KIND/demo.yaml of the checkout, or of the
    folder SPECDRAFT_CONFIGS names (the suite's own, tests/configs, set by tests/conftest.py)."""
    from specdraft.config import SHIPPED_CONFIGS, default_config

    assert default_config("eagle") == Path(__file__).parents[1] / "configs" / "eagle" / "demo.yaml"
    monkeypatch.delenv("SPECDRAFT_CONFIGS")
    assert default_config("eagle") == SHIPPED_CONFIGS / "eagle" / "demo.yaml"
    assert (SHIPPED_CONFIGS / "eagle" / "demo.yaml").is_file()
    monkeypatch.setenv("SPECDRAFT_CONFIGS", str(tmp_path))
    assert default_config("medusa") == tmp_path / "medusa" / "demo.yaml"


def test_parse_cli_config_path_resolution(tmp_path, monkeypatch):
    kind_dir = tmp_path / "configs" / "dummy"
    kind_dir.mkdir(parents=True)
    default = write(kind_dir / "demo.yaml", "max_steps: 11\n")
    write(kind_dir / "big.yaml", "max_steps: 22\n")
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    write(elsewhere / "big.yaml", "max_steps: 33\n")

    # --config replaces the default config (its max_steps: 11 is not applied).
    monkeypatch.chdir(tmp_path)
    assert parse_cli(TrainConfig, ["--config", "work/big.yaml"], default).max_steps == 33
    assert parse_cli(TrainConfig, ["--config=work/big.yaml"], default).max_steps == 33
    assert parse_cli(TrainConfig, ["seed=4", "--config", "work/big.yaml"], default).seed == 4
    # A name not found in the current directory is looked up beside the default config...
    assert parse_cli(TrainConfig, ["--config", "big.yaml"], default).max_steps == 22
    # ...but the current directory comes first.
    monkeypatch.chdir(elsewhere)
    assert parse_cli(TrainConfig, ["--config", "big.yaml"], default).max_steps == 33


def test_parse_cli_errors_exit_2_with_a_message(tmp_path, capsys):
    default = write(tmp_path / "demo.yaml", "")
    for argv, expected in [
        (["--config", "nope.yaml"], "config file not found: nope.yaml"),
        (["--max_steps", "3"], "did you mean max_steps=...?"),
        (["max_stepz=3"], "did you mean 'max_steps'"),
        (["lr=abc"], "command line (lr=abc): lr expects float; got 'abc'"),
        (["report_to=foo"], "report_to='foo' is not one of: none | wandb | tensorboard"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            parse_cli(TrainConfig, argv, default, prog="dummy.py")
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert expected in err and "dummy.py --help" in err
    # argparse's own refusal, in argparse's words.
    with pytest.raises(SystemExit) as exit_:
        parse_cli(TrainConfig, ["--config"], default, prog="dummy.py")
    assert exit_.value.code == 2
    assert "--config: expected one argument" in capsys.readouterr().err


def test_help_lists_every_key_with_type_value_and_comment(tmp_path, capsys):
    default = write(tmp_path / "demo.yaml", "max_steps: 123\n")
    with pytest.raises(SystemExit) as exit_:
        parse_cli(DummyTrainConfig, ["-h", "lr=5e-4"], default, prog="dummy.py")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dummy.py [--config PATH] [key=value ...]")
    keys = list(leaf_keys(DummyTrainConfig))
    assert "data.max_length" in keys and "drafter.depth" in keys and "lr" in keys
    listed = [
        line.split()[0] for line in out.splitlines() if line.startswith("  ") and line[2] != " "
    ]
    assert listed == keys
    # Type, the value this run would use, choices and the field's comment.
    assert any(line.split()[:3] == ["max_steps", "int", "123"] for line in out.splitlines())
    assert any(line.split()[:3] == ["lr", "float", "0.0005"] for line in out.splitlines())
    assert "(cosine | linear | constant)" in out and "(sum | concat)" in out
    assert "Draft tokens per step." in out
    assert "Peak learning rate" in out


def test_help_falls_back_to_defaults_when_config_is_bad(tmp_path):
    text = format_help(TrainConfig, None, ["max_steps=abc"], prog="x")
    assert "the config did not load" in text and "max_steps expects int" in text
    assert any(line.split()[:3] == ["max_steps", "int", "2000"] for line in text.splitlines())


def test_negative_cpu_threads_is_refused():
    with pytest.raises(ConfigError, match="cpu_threads must be >= 0; got -1") as err:
        load_config(TrainConfig, None, ["cpu_threads=-1"])
    assert err.value.key == "cpu_threads"


def test_every_key_has_a_meaning_in_help():
    # The comment above each field is its documentation; a key without one is a gap in --help.
    lines = format_help(TrainConfig, prog="x").splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("  ") and line[2] != " "]
    assert [lines[i].split()[0] for i in rows] == list(leaf_keys(TrainConfig))
    for i in rows:  # each key line is followed by its comment, indented under it
        assert i + 1 < len(lines) and lines[i + 1].startswith("      "), lines[i]


# --- override: key=value items applied to an existing config object ----------------------------


@dataclass(frozen=True)
class Settings:
    # Draft depth.
    gamma: int = 5
    # Chains stop below this confidence.
    stop_below: float = 0.0
    # Weights while drafting.
    draft_weights: str = choice("full", "int8")
    dynamic: bool = False
    layers: list[int] = field(default_factory=lambda: [1, 2])

    def __post_init__(self) -> None:
        if self.gamma < 1:  # a plain ValueError, as the decoding settings raise
            raise ValueError(f"gamma must be >= 1; got {self.gamma}")


def test_override_returns_a_checked_copy():
    base = Settings()
    new = override(base, ["gamma=3", "stop_below=1", "dynamic=true", "layers=[4]"], "--drafter x")
    assert new == Settings(gamma=3, stop_below=1.0, dynamic=True, layers=[4])
    assert isinstance(new.stop_below, float) and new.dynamic is True  # "1" and "true" converted
    assert base == Settings()  # the original is untouched
    assert override(base, [], "--drafter x") == base
    # Nested sections take dotted keys, as on the command line.
    cfg = override(TrainConfig(), ["data.max_length=64", "lr=1e-3"], "test")
    assert (cfg.data.max_length, cfg.lr) == (64, 1e-3) and cfg.max_steps == TrainConfig().max_steps


@pytest.mark.parametrize(
    ("item", "key", "says"),
    [
        ("gama=3", "gama", "unknown key 'gama'; did you mean 'gamma'?"),
        ("gamma=2.5", "gamma", "gamma expects int; got '2.5'"),
        ("stop_below=high", "stop_below", "stop_below expects float; got 'high'"),
        ("dynamic=maybe", "dynamic", "dynamic expects bool; got 'maybe'"),
        ("draft_weights=int4", "draft_weights", "draft_weights='int4' is not one of: full | int8"),
        ("gamma=0", "gamma", "gamma must be >= 1; got 0"),  # the dataclass's own check
        ("gamma", None, "expected key=value, got 'gamma'"),
    ],
)
def test_override_errors_name_the_key_and_source(item, key, says):
    with pytest.raises(ConfigError) as err:
        override(Settings(), ["stop_below=0.5", item], "--drafter runs/x")
    assert str(err.value).startswith("--drafter runs/x") and says in str(err.value)
    if key is not None:
        assert f"--drafter runs/x ({item}): " in str(err.value) and err.value.key == key


def test_target_sharding_is_for_a_frozen_target():
    """LayerSkip and Medusa-2 train the target itself: sharding it as a frozen one is an error
    naming what to do instead; Medusa-1, EAGLE and distillation take it."""
    from specdraft.drafters.base import LoraConfig
    from specdraft.kinds.eagle.eagle_trainer import EagleTrainConfig
    from specdraft.kinds.layerskip.layerskip_trainer import LayerSkipTrainConfig
    from specdraft.kinds.medusa.medusa_config import MedusaConfig
    from specdraft.kinds.medusa.medusa_trainer import MedusaTrainConfig

    with pytest.raises(ConfigError, match=r"LayerSkip fine-tunes the target itself.*ZeRO-3"):
        LayerSkipTrainConfig(target_sharding="zero3")
    with pytest.raises(ConfigError, match=r"Medusa-2.*train Medusa-1"):
        MedusaTrainConfig(target_sharding="zero3", drafter=MedusaConfig(lora=LoraConfig(rank=4)))
    assert MedusaTrainConfig(target_sharding="zero3").target_sharding == "zero3"
    assert EagleTrainConfig(target_sharding="zero3").target_sharding == "zero3"
    assert TrainConfig(target_sharding="zero3").target_sharding == "zero3"  # no drafter section


@pytest.mark.parametrize("key", ["tune_prompts", "tune_passes"])
def test_tuning_needs_a_prompt_and_a_pass(key):
    from specdraft.train.train_config import LoopEvalConfig

    with pytest.raises(ConfigError, match=rf"eval_loop\.{key} must be >= 1; got 0"):
        LoopEvalConfig(**{key: 0})


def test_a_files_keys_for_one_version_do_not_carry_into_another():
    """EAGLE's demo.yaml tunes ttt_steps 3, a draft vocabulary and norm_before_residual for
    EAGLE-3; `drafter.version=eagle1` on the command line gets EAGLE-1's
    defaults for them (ttt_steps 1 once resolved), with a note naming each dropped key, while
    what the command line itself sets, in any order, and every other key stay. Fails with the
    file's values carried over (ttt_steps 3)."""
    from specdraft.config import ConfigNote
    from specdraft.kinds.eagle.eagle import resolve_config
    from specdraft.kinds.eagle.eagle_trainer import EagleTrainConfig

    demo = Path(__file__).parents[2] / "configs" / "eagle" / "demo.yaml"
    with pytest.warns(ConfigNote, match=r"drafter\.ttt_steps \(set in .*demo\.yaml, line \d+\)"):
        cfg = load_config(EagleTrainConfig, demo, ["drafter.version=eagle1"])
    assert (cfg.drafter.ttt_steps, cfg.drafter.draft_vocab_size) == (None, 0)
    assert cfg.drafter.norm_before_residual is False
    assert cfg.lr == load_config(EagleTrainConfig, demo).lr  # not a version's key: kept
    assert resolve_config(cfg.drafter, None).ttt_steps == 1
    for items in (
        ["drafter.version=eagle1", "drafter.ttt_steps=2"],
        ["drafter.ttt_steps=2", "drafter.version=eagle1"],
    ):
        assert load_config(EagleTrainConfig, demo, items).drafter.ttt_steps == 2
    # the file's own version, said again, changes nothing and drops nothing
    assert load_config(EagleTrainConfig, demo, ["drafter.version=eagle3"]).drafter.ttt_steps == 3


def test_override_drops_the_followers_of_what_it_changes():
    """`override` on a loaded config: changing the version drops the values the config held
    for the old one, as the command line does over a file."""
    from specdraft.config import ConfigNote
    from specdraft.kinds.eagle.eagle_trainer import EagleTrainConfig

    demo = Path(__file__).parents[2] / "configs" / "eagle" / "demo.yaml"
    loaded = load_config(EagleTrainConfig, demo)
    with pytest.warns(ConfigNote, match="set in the config given"):
        changed = override(loaded, ["drafter.version=eagle1"])
    assert changed.drafter.ttt_steps is None and changed.lr == loaded.lr
    assert override(loaded, ["lr=1e-3"]).drafter.ttt_steps == 3  # nothing changed: all kept


CONFIGS = Path(__file__).parents[2] / "configs"
KIND_RECIPES = sorted(
    (folder.name, recipe)
    for folder in CONFIGS.iterdir()
    if (folder / "demo.yaml").is_file()
    for recipe in folder.glob("*.yaml")
)


@pytest.mark.parametrize(
    ("kind", "recipe"), KIND_RECIPES, ids=[f"{k}/{r.name}" for k, r in KIND_RECIPES]
)
def test_every_recipe_in_configs_loads_with_its_kinds_config(kind, recipe):
    """Every configs/<kind>/*.yaml (the demo configs and the real-model recipes the README
    lists) passes its trainer's config checks, so a renamed key in a recipe fails here
    rather than on a GPU machine; none trains for the toy demo target: a demo config names a
    real target the package registry provides, with the data that ships with specdraft."""
    from specdraft.data.sources import SHIPPED_ANSWERS
    from specdraft.targets.packaged import PACKAGED_TARGETS
    from specdraft.train.comparison import Recipe

    cfg = load_config(Recipe.of(kind).config_class, recipe)
    assert cfg.kind == kind and not cfg.target.startswith("demo"), recipe
    if "demo" in recipe.name:
        assert cfg.target in PACKAGED_TARGETS and cfg.data.path in SHIPPED_ANSWERS, recipe


def test_loss_chunk_tokens_default_null_and_bad_values():
    """The loss's chunk size: on by default, null or 0 for the whole batch at once, and a value
    that is no size an error naming the key and the fix."""
    from specdraft.losses import DEFAULT_CHUNK_TOKENS

    assert load_config(TrainConfig, None, []).loss_chunk_tokens == DEFAULT_CHUNK_TOKENS > 0
    assert load_config(TrainConfig, None, ["loss_chunk_tokens=null"]).loss_chunk_tokens == 0
    assert load_config(TrainConfig, None, ["loss_chunk_tokens=256"]).loss_chunk_tokens == 256
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, ["loss_chunk_tokens=-8"])
    assert err.value.key == "loss_chunk_tokens"
    assert "loss_chunk_tokens=0" in str(err.value) and "-8" in str(err.value)
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        load_config(TrainConfig, None, ["loss_chunk_tokens=1.5"])


@pytest.mark.parametrize("value", ["1", "-0.1", "2"])
def test_best_within_out_of_range_is_named(value):
    with pytest.raises(ConfigError, match=r"best_within must be in \[0, 1\).*0\.02 for 2%") as err:
        load_config(TrainConfig, None, [f"best_within={value}"])
    assert err.value.key == "best_within"


def test_the_loop_measures_in_native_precision_where_asked(tiny_target, monkeypatch):
    """eval_loop.dtype=native: bf16 where the CPU computes it natively, else fp32; auto: as the
    target was saved."""
    from specdraft.precision import native_bf16
    from specdraft.train.after_training import loop_dtype

    assert loop_dtype("auto", tiny_target) == tiny_target.saved_dtype == torch.float32
    expected = torch.bfloat16 if native_bf16("cpu") else torch.float32
    assert loop_dtype("native", tiny_target) == expected
    monkeypatch.setenv("SPECDRAFT_NO_BF16", "1")
    assert loop_dtype("native", tiny_target) == torch.float32
    assert loop_dtype("bfloat16", tiny_target) == torch.bfloat16
