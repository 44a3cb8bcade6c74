"""Reading a training config: a YAML recipe, presets merged over it, ``--section.key=value`` overrides.

The schema is ``train/schema.py``; pydantic checks what this reads against it, and its errors are
turned into one line naming the dotted key (an unknown key with the valid keys of its section and the
closest match). A YAML mistake names the file, line and column with a caret under it.
"""

from __future__ import annotations

from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from draftsmith.train.registry import unknown_key
from draftsmith.train.schema import TrainConfig, validate


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--trainer.max_steps=5", "--data.paths", "[a, b]"]`` -> nested dict; values parsed as YAML."""
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"cannot read override {arg!r}: write overrides as --section.key=value")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ValueError(f"override --{key} has no value: write --{key}=VALUE")
            raw, i = args[i + 1], i + 1
        i += 1
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ValueError(
                f"override --{key}={raw}: the value is not valid YAML ({_yaml_problem(err)}). Values are read as "
                f"YAML: close lists and mappings (--{key}=[a.jsonl, b.jsonl]) and quote text with : # [ or {{ in "
                f"it (--{key}='\"a: b\"')"
            ) from err
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override --{key} conflicts with an earlier override of {part!r}")
        node[parts[-1]] = value
    return nested


def configs_dir() -> Path:
    """The recipes shipped with draftsmith: package data (``draftsmith.configs``, the repository's
    ``configs/``), so a wheel install finds them as an editable one does."""
    from importlib.resources import files as package_files

    return Path(str(package_files("draftsmith.configs")))


def resolve_recipe(name: str | Path) -> Path:
    """A recipe file: a path that exists, else a shipped recipe by name (``quickstart``,
    ``quickstart.yaml`` or ``configs/quickstart.yaml``)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = configs_dir() / (path.name if path.suffix else f"{path.name}.yaml")
    if shipped.is_file() and (len(path.parts) == 1 or path.parts[-2] == "configs"):
        return shipped
    known = sorted(p.stem for p in configs_dir().glob("*.yaml"))
    raise FileNotFoundError(
        f"config file {name} does not exist, and draftsmith ships no recipe of that name (shipped: "
        f"{', '.join(known)})"
    )


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What PyYAML found wrong, without its pointer to the ``"<unicode string>"`` it parsed."""
    parts = [getattr(err, "context", None), getattr(err, "problem", None)]
    return "; ".join(p for p in parts if p) or str(err).splitlines()[0]


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        line = (
            path.read_text().splitlines()[mark.line]
            if mark is not None and mark.line < len(path.read_text().splitlines())
            else ""
        )
        raise ValueError(
            f"{where}: the {what} is not valid YAML ({_yaml_problem(err)})"
            + (f"\n    {line}\n    {' ' * mark.column}^" if line else "")
            + "\nFix that line: keys are `key: value` at a consistent indent; close every [ and {; quote text with : or # in it."
        ) from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {what} is a mapping of sections (target:, trainer:, ...), got {data!r}")
    return data


def resolve_preset(name: str | Path) -> Path:
    """A preset file: a path, or a name in configs/presets/ (``ddp`` -> configs/presets/ddp.yaml)."""
    path = Path(name)
    if path.is_file():
        return path
    presets = configs_dir() / "presets"
    named = presets / f"{name}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in presets.glob("*.yaml"))
    raise FileNotFoundError(
        f"no preset {str(name)!r}: not a file, and not one of {', '.join(known)} in {presets}"
    )


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``extra`` over ``base``: sections (and ``draft.options``) key by key, values replaced."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


UNKNOWN_KEY = ("unexpected_keyword_argument", "extra_forbidden")
"""pydantic's error types for a key a section does not have."""


def _walk(loc: tuple) -> tuple[Any, list[str]]:
    """The schema type an error's location reaches, and the config keys on the way there."""
    node, keys = TrainConfig, []
    for part in loc:
        if is_dataclass(node) and part in node.__pydantic_fields__:
            node = node.__pydantic_fields__[part].annotation
            keys.append(part)
        elif isinstance(part, int) and keys:  # an item of a list
            keys[-1] += f"[{part}]"
        else:
            break
    return node, keys


def _explain(errors: list[dict[str, Any]]) -> ValueError:
    """One line for pydantic's first error, written as the dotted key a user sets."""
    first = errors[0]
    node, keys = _walk(first["loc"])
    key = ".".join(keys)
    if first["type"] in UNKNOWN_KEY:
        where = f"section {key!r}" if keys else "the top level of the config"
        return unknown_key(".".join(map(str, first["loc"])), list(node.__pydantic_fields__), where)
    if is_dataclass(node):
        valid = ", ".join(f"{key}.{k}" for k in node.__pydantic_fields__)
        return ValueError(f"{key} is a section, not {first['input']!r}; set one of its keys: {valid}")
    said = dict.fromkeys(e["msg"] for e in errors if _walk(e["loc"])[1] == keys)  # each member of a union
    return ValueError(f"{key}={first['input']!r}: {' or '.join(said)}")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    presets: list[str | Path] | tuple[str | Path, ...] = (),
) -> TrainConfig:
    """Read a YAML recipe (or the defaults when path is None), merge presets over it in order (e.g. a
    strategy preset from configs/presets/), apply dotted overrides last, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(resolve_recipe(path), "recipe")
    for preset in presets:
        data = _merge(data, _read_yaml(resolve_preset(preset), "preset"))
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    try:
        config = TypeAdapter(TrainConfig).validate_python(data)
    except ValidationError as err:
        raise _explain(err.errors()) from None
    validate(config)
    return config
