"""``draft.kind`` → the objective that trains it, for the one training loop.

The kinds and their names are ``drafts/base.py``'s records; which of them train, and by which module of
``train/objectives/``, is their line of the one registry, ``KINDS``. That module registers a factory
with ``@register_objective(kind, options=OptionsClass)`` when it is first imported, so reading a recipe
imports no objective. The options class (a pydantic dataclass like ``train/schema.py``'s sections, each
field's docstring its help) is the one source of a kind's ``draft.options``: their check (unknown key
with the closest valid one, type, range, choice), their defaults and their ``train --help`` section.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from draftsmith.drafts.base import KINDS, draft_kind, kind_names
from draftsmith.spelling import closest

if TYPE_CHECKING:
    import torch

    from draftsmith.decode.target import Target
    from draftsmith.train.objective import Objective


def unknown_key(key: str, valid: list[str], where: str) -> ValueError:
    """A ValueError naming an unknown key, the closest valid one and all valid ones."""
    close = closest(key.rsplit(".", 1)[-1], valid)
    hint = f" Did you mean {close!r}?" if close else ""
    return ValueError(f"unknown key {key!r} in {where}.{hint} Valid keys: {', '.join(valid)}")


def objective_module(kind: str) -> str | None:
    """The module that registers ``kind``'s objective (``drafts/base.py``'s ``KINDS`` names it), or None for a
    kind that needs no training (n-gram, layer subset, another pipeline's head)."""
    files = KINDS.get(kind)
    return f"draftsmith.train.objectives.{files.objective}" if files and files.objective else None


ObjectiveFactory = Callable[["Target", dict[str, Any], "torch.Tensor | None"], "Objective"]
"""``(target, draft.options, token_counts or None) -> Objective``: the options are every field of the kind's
options class, checked and with its defaults filled in."""

_OBJECTIVES: dict[str, ObjectiveFactory] = {}
_OPTION_CLASSES: dict[str, type] = {}


def register_objective(kind: str, options: type) -> Callable[[ObjectiveFactory], ObjectiveFactory]:
    """Decorator: make ``draft.kind: <kind>`` build its objective with this factory. ``options``, the kind's
    options class, checks ``draft.options`` (before a target loads) and fills in its defaults."""

    def wrap(factory: ObjectiveFactory) -> ObjectiveFactory:
        _OBJECTIVES[kind] = factory
        _OPTION_CLASSES[kind] = options
        return factory

    return wrap


def options_class(kind: str) -> type:
    """The options class of a trainable kind (importing its objective's module)."""
    _provide(kind)
    return _OPTION_CLASSES[kind]


def parse_options(kind: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """``draft.options`` checked against the options class ``cls``: every field, with its default where
    not given; a ValueError naming each bad key (an unknown one with the closest valid one)."""
    try:
        return dataclasses.asdict(TypeAdapter(cls).validate_python(dict(options)))
    except ValidationError as error:
        fields = sorted(f.name for f in dataclasses.fields(cls))
        problems = []
        for e in error.errors():
            key = ".".join(str(part) for part in e["loc"])
            if e["type"] == "unexpected_keyword_argument":
                raise unknown_key(f"draft.options.{key}", fields, f"draft.options of kind {kind!r}") from None
            if not key and e["type"] == "value_error":  # a check across options (the class's __post_init__)
                problems.append(str((e.get("ctx") or {}).get("error", e["msg"])))
                continue
            problems.append(_option_problem(f"draft.options.{key}", e))
        raise ValueError(f"draft.options of kind {kind!r}: " + "; ".join(problems)) from None


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _option_problem(key: str, e: dict) -> str:
    """One pydantic error as the fix: the bound or the choices the value must meet."""
    ctx, got = e.get("ctx") or {}, e.get("input")
    if e["type"] in _BOUNDS:
        limit = next(iter(ctx.values()))
        return f"{key} must be {_BOUNDS[e['type']]} {limit}, got {got!r}"
    if e["type"] == "literal_error":
        return f"{key} is {got!r}; choose one of {ctx.get('expected')}"
    return f"{key}: {e['msg'].lower()}, got {got!r}"


def check_kind(kind: str) -> None:
    """Refuse a ``draft.kind`` that does not train, importing nothing: an unknown one names the closest
    trainable kind, a training-free one (``ngram``, ...) says it needs no training."""
    if kind in _OBJECTIVES or objective_module(kind):
        return
    if kind not in kind_names():
        raise unknown_key(kind, objective_kinds(), "draft.kind (no such draft kind)")
    raise ValueError(
        f"draft.kind {kind!r} is a {draft_kind(kind).title}: it needs no training. Trainable kinds: "
        f"{', '.join(objective_kinds())}"
    )


def _provide(kind: str) -> None:
    if kind in _OBJECTIVES:
        return
    check_kind(kind)
    module = objective_module(kind)
    importlib.import_module(module)
    if kind not in _OBJECTIVES:
        raise RuntimeError(f"{module} registers no objective for draft.kind {kind!r}")


def check_objective_options(kind: str, options: dict[str, Any]) -> None:
    """The checks of ``draft.kind`` / ``draft.options`` that need no target (unknown kind or key, ...)."""
    _provide(kind)
    parse_options(kind, _OPTION_CLASSES[kind], options)


def objective_kinds() -> list[str]:
    """Every kind with a training objective (``KINDS``, plus objectives registered directly)."""
    return sorted(set(_OBJECTIVES) | {kind for kind in KINDS if objective_module(kind)})


def build_objective(kind: str, target: Target, options: dict[str, Any], token_counts=None) -> Objective:
    """Build the objective for a draft kind (importing the module that provides it on first use)."""
    _provide(kind)
    options = parse_options(kind, _OPTION_CLASSES[kind], options)
    return _OBJECTIVES[kind](target, dict(options), token_counts)
