"""The app layer's side of the engine records (``drafts/engines.py``): their work, loaded on first use.

An engine's writers, verifier and card usage are registered onto its record by
``draftsmith/export/<name>.py``, which ``loaded`` imports the first time the engine is used (a record
registered from elsewhere, with its writers, needs no such module). ``refusal`` is the one answer to
"can this kind go to this engine", read by export, the card and the help.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from draftsmith.drafts.base import DraftKind
from draftsmith.drafts.engines import Engine, Writer, engine_named, export_engines

CARD_K = 5
"""Draft tokens per step in the model card's commands."""


@dataclass(frozen=True)
class ExportOptions:
    """What ``draftsmith export`` passes every writer besides the checkpoint and ``--out``."""

    gguf_dtype: str = "f16"
    target_gguf: str | None = None


@dataclass(frozen=True)
class CardContext:
    """What an engine's usage snippet in the model card is written from."""

    kind: DraftKind
    config: dict
    """The draft's config.json."""
    repo_id: str
    base_model: str
    k: int = CARD_K


def loaded(engine: Engine) -> Engine:
    """``engine`` with its work registered: ``draftsmith/export/<name>.py`` is imported the first time."""
    if not engine.writers and engine.fallback is None:
        module = f"draftsmith.export.{engine.name}"
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"the {engine.name} engine has no writer: register one on its record (Engine.writers), or add "
                f"draftsmith/export/{engine.name}.py that does"
            )
        importlib.import_module(module)
    return engine


def engine_of(engine: str | Engine) -> Engine:
    """The record named (``--to NAME``) or given, with its work loaded."""
    return loaded(engine if isinstance(engine, Engine) else engine_named(engine))


def writer_of(kind: DraftKind, engine: Engine) -> Writer | None:
    """The engine's writer for the kind's family: its own for that family, else its ``fallback`` for a
    family with a checkpoint; None if it has neither."""
    engine = loaded(engine)
    writer = engine.writers.get(kind.family.name)
    if writer is None and kind.family.checkpoint:
        writer = engine.fallback
    return writer


def refusal(kind: DraftKind, engine: Engine) -> str | None:
    """Why ``engine`` cannot take a draft of ``kind`` (the kind's record, the engine's, or no writer for its
    family), or None if it can."""
    why = kind.refusal_by(engine)
    if why is None and writer_of(kind, engine) is None:
        why = kind.refusal or f"draftsmith has no {engine.name} layout for a {kind.title}"
    return why


def refuse(kind: DraftKind, engine: Engine) -> None:
    """Raise the reason ``engine`` cannot take ``kind`` (``refusal``), if it cannot."""
    why = refusal(kind, engine)
    if why is not None:
        raise ValueError(f"--to {engine.name} cannot take a {kind.title} ({kind.name}): {why}")


def engine_names() -> list[str]:
    """``--to`` choices: every engine ``draftsmith export`` writes."""
    return [e.name for e in export_engines()]


def is_single_file(engine: Engine, out: Path) -> bool:
    """Whether ``out`` names the one file an engine's export is (a ``.gguf`` path), not a folder."""
    return engine.file_suffix is not None and out.suffix == engine.file_suffix
