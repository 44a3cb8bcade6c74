"""``draft.kind`` → the objective that trains it, for the one training loop.

The kinds and their names are ``drafts/base.py``'s records; which of them train, and by which module of
``train/objectives/``, is train's own knowledge (``OBJECTIVE_MODULES``). That module registers a factory
with ``@register_objective(kind)`` when it is first imported, so reading a recipe imports no objective.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from draftsmith.drafts.base import DFLASH, DISTILL, EAGLE1, EAGLE3, MEDUSA, MIRROR, draft_kind, kind_names

if TYPE_CHECKING:
    import torch

    from draftsmith.decode.target import Target
    from draftsmith.train.objective import Objective


def unknown_key(key: str, valid: list[str], where: str) -> ValueError:
    """A ValueError naming an unknown key, the closest valid one and all valid ones."""
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown key {key!r} in {where}.{hint} Valid keys: {', '.join(valid)}")


OBJECTIVE_MODULES = {
    EAGLE1: "draftsmith.train.objectives.eagle",
    EAGLE3: "draftsmith.train.objectives.eagle",
    MIRROR: "draftsmith.train.objectives.eagle",
    MEDUSA: "draftsmith.train.objectives.medusa",
    DISTILL: "draftsmith.train.objectives.distill",
    DFLASH: "draftsmith.train.objectives.dflash",
}
"""Trainable kind → the module that registers its objective (imported the first time the kind is asked
for). A kind of ``drafts/`` missing here needs no training (n-gram, layer subset, another pipeline's head)."""

ObjectiveFactory = Callable[["Target", dict[str, Any], "torch.Tensor | None"], "Objective"]
"""``(target, draft.options, token_counts or None) -> Objective``."""

_OBJECTIVES: dict[str, ObjectiveFactory] = {}
_OPTION_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {}


def register_objective(
    kind: str, check: Callable[[dict[str, Any]], None] | None = None
) -> Callable[[ObjectiveFactory], ObjectiveFactory]:
    """Decorator: make ``draft.kind: <kind>`` build its objective with this factory. ``check(options)``
    refuses bad ``draft.options`` without a target, so a run fails before it loads one."""

    def wrap(factory: ObjectiveFactory) -> ObjectiveFactory:
        _OBJECTIVES[kind] = factory
        if check is not None:
            _OPTION_CHECKS[kind] = check
        return factory

    return wrap


def check_kind(kind: str) -> None:
    """Refuse a ``draft.kind`` that does not train, importing nothing: an unknown one names the closest
    trainable kind, a training-free one (``ngram``, ...) says it needs no training."""
    if kind in _OBJECTIVES or kind in OBJECTIVE_MODULES:
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
    importlib.import_module(OBJECTIVE_MODULES[kind])
    if kind not in _OBJECTIVES:
        raise RuntimeError(f"{OBJECTIVE_MODULES[kind]} registers no objective for draft.kind {kind!r}")


def check_objective_options(kind: str, options: dict[str, Any]) -> None:
    """The checks of ``draft.kind`` / ``draft.options`` that need no target (unknown kind or key, ...)."""
    _provide(kind)
    if kind in _OPTION_CHECKS:
        _OPTION_CHECKS[kind](dict(options))


def objective_kinds() -> list[str]:
    """Every kind with a training objective (``OBJECTIVE_MODULES``, plus objectives registered directly)."""
    return sorted(set(_OBJECTIVES) | set(OBJECTIVE_MODULES))


def build_objective(kind: str, target: Target, options: dict[str, Any], token_counts=None) -> Objective:
    """Build the objective for a draft kind (importing the module that provides it on first use)."""
    _provide(kind)
    return _OBJECTIVES[kind](target, dict(options), token_counts)


def check_options(cls: type, kind: str, options: dict[str, Any]) -> None:
    """Refuse ``draft.options`` keys that ``cls``'s constructor does not take, naming the valid ones."""
    accepted = _constructor_options(cls)
    for key in options:
        if accepted is not None and key not in accepted:
            raise unknown_key(f"draft.options.{key}", sorted(accepted), f"draft.options of kind {kind!r}")


def _constructor_options(cls: type) -> set[str] | None:
    """Keyword options a class's constructor takes, following ``**options`` up the MRO (None = unknown)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[2:]  # self, target
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names - {"token_counts", "preset"}
    return None
