"""Typed training configs: recipes, dotted overrides, loud errors, help text from docstrings."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from draftsmith.cli import main
from draftsmith.train.config import load_config, parse_overrides
from draftsmith.train.registry import build_objective, check_objective_options, objective_kinds
from draftsmith.train.schema import TrainConfig, describe, to_dict

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
PATHS = "--data.paths=[a.jsonl]"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_recipes_exist():
    names = {p.name for p in CONFIGS}
    assert {"debug_eagle3.yaml", "quickstart.yaml", "smollm2_eagle3.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_recipe_parses(path):
    config = load_config(path)
    assert isinstance(config, TrainConfig) and (config.data.paths or config.data.regenerated)
    assert config.draft.kind in objective_kinds()
    check_objective_options(config.draft.kind, config.draft.options)  # its kind's options class takes them


def test_every_key_has_help_text():
    sections = [type(getattr(TrainConfig(), f.name)) for f in dataclasses.fields(TrainConfig)]
    for cls in [TrainConfig, *filter(dataclasses.is_dataclass, sections)]:
        missing = {name for name, info in cls.__pydantic_fields__.items() if not info.description}
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    text = describe()
    assert "trainer.max_steps" in text and "Optimizer steps to train for." in text and "draft.options" in text
    # types read as a user writes them, not as typing spells them
    assert "mode  (online|offline, default 'online')" in text and "data.limit  (int > 0|null," in text
    assert "Literal[" not in text and "Optional[" not in text


def test_yaml_and_overrides(tmp_path):
    path = write(
        tmp_path,
        "data:\n  paths: [x.jsonl]\noptim:\n  lr: 1e-4\ndraft:\n  kind: eagle3\n  options: {ttt_steps: 2}\n",
    )
    config = load_config(
        path,
        ["--trainer.max_steps=7", "--optim.betas=[0.8, 0.9]", "--data.pack", "true", "--draft.options.num_layers=2",
         "--data.limit=null", "--mode=offline", "--trainer.devices=auto"],
    )  # fmt: skip
    assert config.optim.lr == 1e-4 and isinstance(config.optim.lr, float)  # YAML 1.1 reads 1e-4 as a string
    assert config.trainer.max_steps == 7 and config.data.pack is True and config.data.limit is None
    assert config.optim.betas == (0.8, 0.9) and config.mode == "offline" and config.trainer.devices == "auto"
    assert config.draft.options == {"ttt_steps": 2, "num_layers": 2}  # merged, not replaced
    assert config.data.paths == ["x.jsonl"]


def test_a_single_path_is_a_list_and_empty_options_are_none(tmp_path):
    config = load_config(write(tmp_path, "data:\n  paths: x.jsonl\ndraft:\n  options:\n"))
    assert config.data.paths == ["x.jsonl"] and config.draft.options == {}


def test_resolved_config_round_trips(tmp_path):
    config = load_config(CONFIGS[0], ["--optim.betas=[0.8, 0.9]"])
    again = load_config(write(tmp_path, yaml.safe_dump(to_dict(config))))
    assert again == config


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--trainer.max_step=3"],
            r"unknown key 'trainer.max_step'.*Did you mean 'max_steps'.*Valid keys: max_steps",
        ),
        (["--traner.max_steps=3"], r"unknown key 'traner'.*Did you mean 'trainer'"),
        (["--trainer=3"], r"trainer is a section, not 3; set one of its keys: trainer.max_steps"),
        (["--optim.lr=fast"], r"optim.lr='fast': Input should be a valid number"),
        (["--trainer.batch_size=2.5"], r"trainer.batch_size=2.5: Input should be a valid integer"),
        (["--mode=sometimes"], r"mode='sometimes': Input should be 'online' or 'offline'"),
        (["--trainer.max_steps=0"], r"trainer.max_steps=0: Input should be greater than 0"),
        (["--trainer.max_time=-1"], r"trainer.max_time=-1: Input should be greater than 0"),
        (
            ["--trainer.devices=[1]"],
            r"trainer.devices=\[1\]: Input should be a valid integer or .* valid string",
        ),
        (["--data.paths=[a, {b: 1}]"], r"data.paths\[1\]={'b': 1}: Input should be a valid string"),
        (["--draft.kind=eagle4"], r"unknown key 'eagle4' in draft.kind.*Did you mean 'eagle3'"),
        (["--trainer.max_steps"], r"has no value"),
        (["trainer.max_steps=3"], r"write overrides as --section.key=value"),
    ],
)
def test_bad_overrides_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [PATHS, *args])


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--optim.lr=-1", r"optim.lr=-1: Input should be greater than 0"),
        ("--optim.lr=0", r"optim.lr=0: Input should be greater than 0"),
        ("--optim.betas=[0.9, 1.0]", r"optim.betas\[1\]=1.0: Input should be less than 1"),
        ("--optim.betas=[-0.1, 0.9]", r"optim.betas\[0\]=-0.1: Input should be greater than or equal to 0"),
        (
            "--optim.weight_decay=-0.01",
            r"optim.weight_decay=-0.01: Input should be greater than or equal to 0",
        ),
        ("--optim.warmup_steps=-5", r"optim.warmup_steps=-5: Input should be greater than or equal to 0"),
        ("--optim.min_lr_ratio=1.5", r"optim.min_lr_ratio=1.5: Input should be less than or equal to 1"),
        ("--optim.grad_clip=0", r"optim.grad_clip=0: Input should be greater than 0"),
        ("--data.max_length=0", r"data.max_length=0: Input should be greater than 0"),
        ("--data.limit=-1", r"data.limit=-1: Input should be greater than 0"),
        ("--data.seed=-1", r"data.seed=-1: Input should be greater than or equal to 0"),
        ("--trainer.seed=-3", r"trainer.seed=-3: Input should be greater than or equal to 0"),
        ("--trainer.num_workers=-1", r"trainer.num_workers=-1: Input should be greater than or equal to 0"),
        ("--trainer.batch_size=0", r"trainer.batch_size=0: Input should be greater than 0"),
        ("--cache.batch_size=0", r"cache.batch_size=0: Input should be greater than 0"),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_key_and_the_range(arg, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [PATHS, arg])


def test_a_negative_learning_rate_fails_before_anything_is_written(tmp_path, capsys):
    recipe = write(tmp_path, "data: {paths: [builtin:gsm8k_train]}\n")
    out = tmp_path / "run"
    assert main(["train", str(recipe), f"--output.dir={out}", "--optim.lr=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "optim.lr=-1: Input should be greater than 0" in err
    assert not out.exists()


def _holds_float(tp) -> bool:
    """Whether a field's type takes a float anywhere in it (``float``, ``float | None``, a tuple of ranges)."""
    return tp is float or any(_holds_float(a) for a in typing.get_args(tp))


def _float_keys() -> list[tuple[str, str, int]]:
    """(kind or "", dotted key, tuple length or 0) of every float a recipe takes: the sections' and each
    trainable kind's ``draft.options``."""
    from draftsmith.train.registry import options_class

    keys = []
    for name, section in TrainConfig.__pydantic_fields__.items():
        if dataclasses.is_dataclass(section.annotation):
            for key, info in section.annotation.__pydantic_fields__.items():
                if _holds_float(info.annotation):
                    tuple_of = (
                        typing.get_args(info.annotation)
                        if typing.get_origin(info.annotation) is tuple
                        else ()
                    )
                    keys.append(("", f"{name}.{key}", len(tuple_of)))
    for kind in objective_kinds():
        cls = options_class(kind)
        for key, info in cls.__pydantic_fields__.items():
            if _holds_float(info.annotation):
                keys.append((kind, f"draft.options.{key}", 0))
    return keys


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_no_float_key_takes_a_number_that_is_not_finite(value):
    """Every float of a recipe, present and future, refuses infinity and NaN naming its key (one rule for
    all of them: ``schema.SECTION``), whatever its range would let through."""
    keys = _float_keys()
    assert {"optim.lr", "optim.weight_decay", "optim.grad_clip", "trainer.max_time"} <= {
        k for _, k, _ in keys
    }
    assert any(kind for kind, _, _ in keys)  # the kinds' options are walked too
    for kind, key, size in keys:
        given = f"[{', '.join([value] * size)}]" if size else value
        with pytest.raises(ValueError, match=rf"{re.escape(key)}.*finite number"):
            config = load_config(None, [PATHS, f"--draft.kind={kind or 'eagle3'}", f"--{key}={given}"])
            check_objective_options(config.draft.kind, config.draft.options)


def test_an_infinite_learning_rate_fails_in_one_line_before_anything_is_written(tmp_path, capsys):
    recipe = write(tmp_path, "data: {paths: [builtin:gsm8k_train]}\n")
    out = tmp_path / "run"
    argv = [
        "train",
        str(recipe),
        f"--output.dir={out}",
        "--trainer.max_steps=1",
        "--data.limit=8",
        "--data.heldout=2",
    ]
    assert main([*argv, "--optim.lr=.inf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "optim.lr=inf: Input should be a finite number" in err
    assert not out.exists()


def test_unknown_yaml_key_is_named(tmp_path):
    path = write(tmp_path, "data:\n  paths: [x.jsonl]\n  max_lenght: 10\n")
    with pytest.raises(ValueError, match=r"unknown key 'data.max_lenght' in section 'data'.*'max_length'"):
        load_config(path)


def test_empty_data_is_an_error():
    with pytest.raises(ValueError, match="data.paths is empty"):
        load_config(None, [])


def test_parse_overrides_nests():
    assert parse_overrides(["--a.b.c=1", "--a.d", "[1, 2]"]) == {"a": {"b": {"c": 1}, "d": [1, 2]}}


def test_cli_help_lists_sections(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for key in (
        "target.spec",
        "data.paths",
        "draft.options",
        "optim.lr",
        "trainer.val_every",
        "output.dir",
        "mode",
    ):
        assert key in out


def test_cli_unknown_override_exits_with_valid_keys(capsys):
    code = main(["train", str(CONFIGS[0]), "--optim.learning_rate=1"])
    assert code == 2
    assert "unknown key 'optim.learning_rate'" in capsys.readouterr().err


def test_objective_options_are_checked():
    from tiny import tiny_target

    target = tiny_target("llama", layers=4)
    with pytest.raises(ValueError, match=r"unknown key 'draft.options.ttt_step'.*'ttt_steps'"):
        build_objective("eagle3", target, {"ttt_step": 2}, None)
    objective = build_objective("eagle3", target, {"ttt_steps": 2, "draft_vocab_size": 259}, None)
    assert objective.capture_layers and objective.teacher_topk > 0


@pytest.mark.parametrize("flag", ["--resume", "--overwrite", "--force-resume"])
@pytest.mark.parametrize("at", [1, 2, 4])
def test_cli_passes_config_and_flags_to_the_loop(monkeypatch, at, flag):
    import draftsmith.train.loop as loop

    calls = []
    monkeypatch.setattr(loop, "train", lambda config, **flags: calls.append((config, flags)))
    argv = ["train", str(CONFIGS[0]), "--trainer.max_steps=3"]
    argv.insert(at, flag)
    assert main(argv) == 0
    ((config, flags),) = calls
    assert config.trainer.max_steps == 3
    command = flags.pop("resume_command")  # what a preempted run prints: this run again, with --resume
    rerun = flags.pop("rerun_command")  # ... and before its first checkpoint: this run again, without it
    assert flags == {
        name: f"--{name.replace('_', '-')}" == flag for name in ("resume", "overwrite", "force_resume")
    }
    again = f"draftsmith train {CONFIGS[0]} --trainer.max_steps=3"
    assert command == again + " --resume" + (" --force-resume" if flag == "--force-resume" else "")
    assert rerun == again + (" --overwrite" if flag == "--overwrite" else "")


PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs" / "presets").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_combines_with_a_recipe(preset):
    recipe = load_config(CONFIGS[0])
    config = load_config(CONFIGS[0], ["--trainer.max_steps=3"], presets=[preset.stem])
    assert config.data == recipe.data and config.draft == recipe.draft  # the recipe's own sections stay
    assert config.trainer.max_steps == 3  # overrides still win over the preset
    assert load_config(CONFIGS[0], presets=[preset]) == load_config(CONFIGS[0], presets=[preset.stem])
    assert {"ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"} <= {p.stem for p in PRESETS}


def test_presets_apply_in_order_and_unknown_ones_are_named(tmp_path):
    config = load_config(None, [PATHS], presets=["ddp", "multinode_slurm"])
    assert (
        config.trainer.strategy == "ddp"
        and config.trainer.num_nodes == 2
        and config.target.dtype == "bfloat16"
    )
    with pytest.raises(FileNotFoundError, match=r"no preset 'dpp'.*ddp"):
        load_config(None, [PATHS], presets=["dpp"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  stratgy: ddp\n")
    with pytest.raises(ValueError, match=r"unknown key 'trainer.stratgy'.*'strategy'"):
        load_config(None, [PATHS], presets=[bad])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--trainer.strategy=deepspeed_stage2"],
            r"unknown key 'deepspeed_stage2' in trainer.strategy.*'deepspeed_stage_2'",
        ),
        (["--trainer.num_nodes=0"], r"trainer.num_nodes=0: Input should be greater than 0"),
        (
            ["--target.device_map=balanced"],
            r"target.device_map='balanced': Input should be 'auto' or 'device'",
        ),
        (
            ["--cache.feature_dtype=fp8"],
            r"cache.feature_dtype='fp8': Input should be 'auto', 'bfloat16' or 'float8'",
        ),
    ],
)
def test_distributed_keys_are_checked(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [PATHS, *args])


def test_cli_passes_presets(monkeypatch):
    import draftsmith.train.loop as loop

    calls = []
    monkeypatch.setattr(loop, "train", lambda config, **flags: calls.append((config, flags)))
    assert (
        main(
            ["train", str(CONFIGS[0]), "--preset", "fsdp", "--trainer.devices=4", "--preset=multinode_slurm"]
        )
        == 0
    )
    ((config, flags),) = calls
    assert config.trainer.strategy == "fsdp" and config.trainer.devices == 4 and config.trainer.num_nodes == 2
    assert flags["resume"] is False
