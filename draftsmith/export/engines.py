"""The app layer's side of the engine records (``drafts/engines.py``): their work, loaded on first use.

An engine's own writers, verifier and card usage are registered onto its record by
``draftsmith/export/<name>.py``; a kind's writers, verifiers and card sections for every engine that serves
it by the kind's export module (``drafts/base.KINDS``). ``loaded`` imports both the first time an engine is
used (a record registered from elsewhere, with its writers, needs no module of its own). ``refusal`` is the
one answer to "can this kind go to this engine", read by export, the card and the help; ``usage_of`` and
``verifier_of`` are the dispatch to a family's own section and check.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.drafts.base import KINDS, DraftKind
from draftsmith.drafts.engines import Engine, Recognise, Usage, Verifier, Writer, engine_named, export_engines

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


def load_kind_exports() -> None:
    """Import every kind's export module (``drafts/base.KINDS``): each registers its work onto the engine
    records (importing a module twice does nothing)."""
    for files in KINDS.values():
        if files.export:
            importlib.import_module(f"draftsmith.export.{files.export}")


def architecture_is(name: str) -> Recognise:
    """An export's config.json names ``name`` as its only architecture."""
    return lambda config: config.get("architectures") == [name]


def checked(what: str, problems: Callable[[Path], list[str]]) -> Verifier:
    """A verifier saying ``what`` it checked, from a function of the folder to its problems."""
    return lambda folder: (what, problems(folder))


def register_family(
    family: str,
    engine: Engine,
    writer: Writer,
    usage: Usage | None = None,
    verifier: tuple[Recognise, Verifier] | None = None,
    help: str | None = None,
) -> None:
    """Put a family's work for ``engine`` on the engine's record: its writer, its card section (None: the
    engine's own), its verifier as (recognise the export's config.json, check it) (None: the engine's own),
    its line of ``export --help`` ("Kind: the class the engine loads")."""
    engine.writers[family] = writer
    if help is not None:
        engine.family_help[family] = help
    if usage is not None:
        engine.usages[family] = usage
    if verifier is not None:
        engine.verifiers[family] = verifier


def loaded(engine: Engine) -> Engine:
    """``engine`` with its work registered: the kinds' export modules and ``draftsmith/export/<name>.py``
    are imported the first time."""
    load_kind_exports()
    module = f"draftsmith.export.{engine.name}"
    if importlib.util.find_spec(module) is not None:
        importlib.import_module(module)
    elif not engine.writers and engine.fallback is None:
        raise ValueError(
            f"the {engine.name} engine has no writer: register one on its record (Engine.writers), or add "
            f"draftsmith/export/{engine.name}.py that does"
        )
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


def usage_of(kind: DraftKind, engine: Engine) -> Usage | None:
    """The model card's section for ``kind`` on ``engine``: its family's own, else the engine's."""
    engine = loaded(engine)
    return engine.usages.get(kind.family.name, engine.usage)


def verifier_of(engine: Engine, config: dict) -> Verifier | None:
    """The check of an export whose config.json is ``config``: the family's whose layout it is, else the
    engine's own."""
    engine = loaded(engine)
    for recognise, verify in engine.verifiers.values():
        if recognise(config):
            return verify
    return engine.verify


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
