"""The registry that builds drafters from a spec string; the protocol itself is ``decode/drafter.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.decode.drafter import Drafter, Proposal

if TYPE_CHECKING:
    from draftsmith.decode.target import Target

__all__ = ["Drafter", "Proposal"]


RUN_DRAFT = "draft"
"""Where a ``draftsmith train`` run directory keeps its draft: ``--draft RUN`` reads ``RUN/draft``."""

DrafterFactory = Callable[["Target", str], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(kind: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a factory ``(target, argument) -> Drafter`` under a kind name (``ngram``, ``layers``, ...)."""

    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[kind] = factory
        return factory

    return wrap


def registered_kinds() -> list[str]:
    return sorted(_REGISTRY)


def build_drafter(spec: str, target: Target) -> Drafter:
    """Build a drafter from a spec: ``ngram``, ``ngram:N``, ``layers:N``, or a path / model id.

    A directory saved by draftsmith names its kind in ``config.json`` (``draftsmith_kind``) and is
    built by that kind; any other path or model id is loaded as an independent causal-LM draft.
    """
    import draftsmith.drafts  # noqa: F401  (imports every kind so it registers)
    from draftsmith.drafts.loading import kind_of_checkpoint

    kind, _, arg = spec.partition(":")
    if kind in _REGISTRY and kind not in ("causal_lm",):
        return _REGISTRY[kind](target, arg)
    from draftsmith.hub import resolve_pretrained

    spec = resolve_pretrained(spec, what="draft")  # a Hub id becomes its local snapshot (cache first)
    run_draft = Path(spec) / RUN_DRAFT
    if not (Path(spec) / "config.json").is_file() and (run_draft / "config.json").is_file():
        spec = str(run_draft)  # a `draftsmith train` run directory: its draft
    elif Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        raise FileNotFoundError(
            f"--draft {spec} holds no draft: expected config.json in it (a draft directory) or draft/config.json "
            "(a `draftsmith train` run directory; it appears once the run has validated)"
        )
    kind = kind_of_checkpoint(spec)
    if kind not in _REGISTRY:
        raise ValueError(
            f"draft {spec!r} is a draftsmith checkpoint of kind {kind!r}, which this version cannot load "
            f"(known kinds: {', '.join(registered_kinds())})"
        )
    return _REGISTRY[kind](target, spec)
