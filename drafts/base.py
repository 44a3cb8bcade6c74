"""The kinds of draft, one record each, and the one registry that builds drafters from a spec.

A ``DraftKind`` owns what differs between kinds: its one name (the ``--draft`` spec prefix of a
training-free kind, ``draftsmith_kind`` in a saved ``config.json``, ``draft.kind`` in a training recipe,
the model card's tag), what the card calls it, how it loads, its ``Family``, the engines it exports to
(records of ``drafts/engines.py``) and why it refuses the others. A ``Family`` is how drafts are stored:
whether there is a checkpoint, the check of its saved folder (``--to hf``), its lines of the model card;
engine records key their writers and refusals by its name. A kind's file in ``drafts/`` registers its
record and spells its name once (a constant there); the registry imports that file the first time the
kind is asked for (``KINDS``), so reading a config or a spec never imports torch. Adding a kind = one file
here (model, drafter, family, record), if it trains one objective in ``train/objectives/``, if engines
serve it one module in ``draftsmith/export/`` that registers its writers, verifiers and card sections onto
the engine records, and one line of ``KINDS`` naming them (bare module names: train/ and the export
package find them there; this layer imports neither).

Every trained draft records the target it was trained for (``Target.record()``); ``check_target`` is
the one check, shared by every kind, that a draft meets that target.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith import files
from draftsmith.decode.drafter import Drafter
from draftsmith.decode.features import LAYER_ID_CONVENTION
from draftsmith.drafts.engines import Engine
from draftsmith.spelling import closest

if TYPE_CHECKING:
    from draftsmith.decode.target import Target

DRAFT_KIND_KEY = "draftsmith_kind"
"""The ``config.json`` key that names a saved draft's kind."""
RUN_DRAFT = "draft"
"""Where a ``draftsmith train`` run directory keeps its draft: ``--draft RUN`` reads ``RUN/draft``."""
TARGET_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "tokenizer_fingerprint")
"""Fields of ``Target.record()`` that must agree for a draft to be used with a target (the name may differ)."""

PEER_EAGLE3 = "peer_eagle3"
"""The kind of an EAGLE-3 head another pipeline wrote (SpecForge, ModelOpt, speculators, SafeAILab/EAGLE):
read into draftsmith's head for the target it is used with (``drafts/eagle_import.py``)."""
PEER_DFLASH = "peer_dflash"
"""The kind of a DFlash draft another pipeline wrote (SpecForge, speculators; vLLM's layout): read into
draftsmith's ``DFlashDraft`` for the target it is used with (``drafts/dflash_import.py``)."""
FOREIGN_EAGLE_FIELDS = ("draft_vocab_size", "eagle_config", "eagle_aux_hidden_state_layer_ids", "speculators_config",
                        "speculators_model_type", "target_hidden_size")  # fmt: skip
"""config.json fields EAGLE heads of other pipelines write and causal LMs do not."""

DrafterFactory = Callable[["Target", str], Drafter]
"""``(target, argument) -> Drafter``: the argument is a checkpoint directory, or a spec's ``:N`` part."""
FolderCheck = Callable[[Path], list[str]]
"""``folder -> problems`` of a saved draft folder (empty: it loads as saved)."""


def strict_load(cls, folder: Path):
    """``cls.from_pretrained(folder)`` and the problems of the load: missing, unexpected, mis-shaped weights."""
    model, info = cls.from_pretrained(str(folder), output_loading_info=True)
    problems = [
        f"{kind} weights: {sorted(names)}" for kind, names in info.items() if names and kind != "error_msgs"
    ]
    return model, problems + [str(m) for m in info.get("error_msgs") or []]


def loads_strictly(cls) -> FolderCheck:
    """The hf check of a family whose drafts are one ``PreTrainedModel`` class: a strict ``from_pretrained``
    (``strict_load``) and a target record in its config."""

    def check(folder: Path) -> list[str]:
        model, problems = strict_load(cls, folder)
        if not model.config.target:
            problems.append("config.target records no target")
        return problems

    return check


def check_saved_draft(folder: Path) -> list[str]:
    """The check of a saved folder every family with a checkpoint gets unless it brings its own: config.json
    names a known kind and the target it was trained for, and the weights are there (whole: the caller's
    ``files.check_model_files``)."""
    config = files.read_json(Path(folder) / "config.json", DRAFT_FIX)
    problems = []
    if DRAFT_KIND_KEY not in config:
        problems.append(f"config.json names no {DRAFT_KIND_KEY}: nothing says how to load it")
    else:
        kind = kind_of_config(config)
        missing = [f for f in TARGET_FIELDS if f not in (config.get(kind.target_key) or {})]
        if missing:
            problems.append(
                f"config.json's {kind.target_key} lacks {', '.join(missing)}: the target check cannot run"
            )
    if not list(Path(folder).glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    return problems


def target_layers_line(config: dict) -> str:
    """The card's line for a draft that reads the target's layers (``capture_layer_ids``)."""
    return (
        f"- reads target layers {config.get('capture_layer_ids')} ({config.get('layer_id_convention')}: output "
        "of decoder layer i, 0-based, before the final norm)"
    )


@dataclass(frozen=True)
class Family:
    """How a kind's drafts are stored, checked and described: kinds that share a layout share a family
    (EAGLE-1, EAGLE-3 and mirror heads are ``eagle``). Engine records key their writers and refusals by its
    name; the rest is here, as plain functions over config dicts and folders that the app layer calls."""

    name: str
    """The key of ``Engine.writers`` and ``Engine.refuses`` ("eagle", "causal_lm", ...)."""
    title: str
    """What help and errors call such drafts ("EAGLE head")."""
    checkpoint: bool = True
    """Whether a draft is a saved directory (False: it is built from its spec alone, ``ngram:N``)."""
    verify_hf: FolderCheck = check_saved_draft
    """The check of a folder in draftsmith's transformers layout (``--to hf``, ``export --verify``)."""
    hf_writer: Callable[..., Path] | None = None
    """``(checkpoint, out, ExportOptions) -> folder`` for ``--to hf``; None: the draft directory as it is."""
    hf_usage: Callable[[str, str], list[str]] | None = None
    """``(base_model, repo_id) -> the card's transformers section``; None: the lines that run it with
    draftsmith's decoder."""
    card_lines: Callable[[dict], list[str]] | None = None
    """``config.json -> the card's lines about the draft`` after its target's (None: none)."""
    library_name: str = "draftsmith"
    """The card's ``library_name``: what loads it."""


TRAINING_FREE = Family("training-free", "training-free drafter", checkpoint=False)
"""Drafters built from a spec (``ngram``, ``layers:N``): nothing saved, nothing to export."""


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft: everything the rest of draftsmith needs to know about it."""

    name: str
    """The one name, used everywhere: ``--draft NAME[:N]`` (training-free kinds), ``draftsmith_kind`` in
    config.json, ``draft.kind`` in a recipe, the card's tag."""
    title: str
    """What a model card or an error calls it ("EAGLE-3 head")."""
    build: DrafterFactory
    family: Family
    """How it is stored, checked and served (a ``Family`` record, declared beside the kinds that share it)."""
    exports: tuple[Engine, ...] | None = None
    """The engines (records, ``drafts/engines.py``) it goes to; None: every engine with a writer for its
    family that does not refuse the family."""
    refusal: str = ""
    """Why it cannot go to the engines ``exports`` leaves out (said as the error)."""
    target_key: str = "target"
    """Where its config.json records the target it was trained for."""
    read_for: Callable[[Target, str | Path], Any] | None = None
    """A layout another pipeline wrote: ``(target, folder) -> draftsmith's model of it`` for that target, which
    export and publish start from (None: draftsmith's own layout, exported as it is)."""

    def refusal_by(self, engine: Engine) -> str | None:
        """Why ``engine`` cannot take this kind, by the kind's record or the engine's; None if neither refuses
        (whether a writer exists is the export package's to say: ``draftsmith.export.refusal``)."""
        if self.exports is not None and engine not in self.exports:
            return self.refusal or f"draftsmith has no {engine.name} layout for a {self.title}"
        if self.family.name in engine.refuses:
            return engine.refuses[self.family.name]
        return None

    def refuse_export(self, engine: Engine) -> None:
        """Raise why ``engine`` cannot take this kind by the two records, if it cannot."""
        why = self.refusal_by(engine)
        if why is not None:
            raise ValueError(f"--to {engine.name} cannot take a {self.title} ({self.name}): {why}")


EAGLE1 = "eagle1"
EAGLE3 = "eagle3"
MIRROR = "mirror"
DISTILL = "distill"
MEDUSA = "medusa"
DFLASH = "dflash"
DSPARK = "dspark"
PEAGLE = "peagle"
NGRAM = "ngram"
LAYERS = "layers"
"""The kinds' names, spelled here once (beside ``PEER_EAGLE3``) so that the registry, recipes, train's
objective map and the app name a kind without importing its module."""


@dataclass(frozen=True)
class KindFiles:
    """Where a kind's parts live, each named by its module in its own folder (bare names, so that this layer
    names no module above it): the one line a kind adds to ``KINDS``."""

    drafts: str
    """``drafts/<drafts>.py``: its model, drafter, family and record (imported the first time it is asked for)."""
    objective: str | None = None
    """``train/objectives/<objective>.py``: the objective that trains it (None: nothing to train)."""
    export: str | None = None
    """``draftsmith/export/<export>.py``: its writers, verifiers and card sections per engine, registered onto
    the engine records (None: the engines' own writers for its family, or none)."""


KINDS = {
    EAGLE1: KindFiles("eagle", objective="eagle"),
    EAGLE3: KindFiles("eagle", objective="eagle"),
    MIRROR: KindFiles("mirror", objective="eagle"),
    DISTILL: KindFiles("distill", objective="distill"),
    MEDUSA: KindFiles("medusa", objective="medusa", export="medusa"),
    DFLASH: KindFiles("dflash", objective="dflash", export="dflash"),
    DSPARK: KindFiles("dspark", objective="dspark", export="dspark"),
    PEAGLE: KindFiles("peagle", objective="peagle", export="peagle"),
    NGRAM: KindFiles("ngram"),
    LAYERS: KindFiles("layer_subset"),
    PEER_EAGLE3: KindFiles("eagle_import"),
    PEER_DFLASH: KindFiles("dflash_import"),
}
"""The one registry of kinds: name -> where its parts live. The drafts registry imports ``drafts`` on first
use, train's registry ``objective``, the export package every ``export`` before an engine writes."""
LEGACY_KINDS = {"eagle": None, "small_lm": DISTILL, "causal_lm": DISTILL}
"""Names earlier versions wrote; ``eagle`` is resolved by the head's ``preset``."""
_KINDS: dict[str, DraftKind] = {}


def register(kind: DraftKind) -> DraftKind:
    """Make a kind known (its module calls this at import)."""
    _KINDS[kind.name] = kind
    return kind


def kind_names() -> list[str]:
    return sorted(set(KINDS) | set(_KINDS))


def draft_kind(name: str) -> DraftKind:
    """The record of the kind called ``name``; an error naming the closest known one otherwise."""
    if name not in _KINDS and name in KINDS:
        importlib.import_module(f"draftsmith.drafts.{KINDS[name].drafts}")
    if name not in _KINDS:
        close = closest(name, kind_names())
        hint = f" Did you mean {close!r}?" if close else ""
        raise ValueError(f"unknown draft kind {name!r}.{hint} Known kinds: {', '.join(kind_names())}")
    return _KINDS[name]


def is_foreign_eagle(config: dict) -> bool:
    """True for a ``config.json`` draftsmith did not write that looks like an EAGLE head (its architecture
    or its fields say so): it is read by ``drafts/eagle_import.py``, never as an independent causal LM."""
    if DRAFT_KIND_KEY in config:
        return False
    arch = " ".join(str(a) for a in config.get("architectures") or []).lower()
    return "eagle" in arch or "speculator" in arch or any(key in config for key in FOREIGN_EAGLE_FIELDS)


def is_foreign_dflash(config: dict) -> bool:
    """True for a ``config.json`` draftsmith did not write that is a DFlash draft (SpecForge's and vLLM's
    ``DFlashDraftModel``, speculators' ``dflash``): read by ``drafts/dflash_import.py``."""
    if DRAFT_KIND_KEY in config:
        return False
    return config.get("speculators_model_type") == "dflash" or "DFlashDraftModel" in (
        config.get("architectures") or []
    )


def kind_of_config(config: dict) -> DraftKind:
    """The kind a saved draft's ``config.json`` (as a dict) says it is; a plain causal LM is ``distill``, an
    EAGLE head from another pipeline ``peer_eagle3``, a DFlash draft from one ``peer_dflash``."""
    foreign = (
        PEER_DFLASH if is_foreign_dflash(config) else PEER_EAGLE3 if is_foreign_eagle(config) else DISTILL
    )
    name = config.get(DRAFT_KIND_KEY) or foreign
    if name in LEGACY_KINDS:
        name = LEGACY_KINDS[name] or config.get("preset", EAGLE3)
    return draft_kind(name)


DRAFT_FIX = "Copy or download the draft again (a training run writes draft/ anew when resumed with --resume)"
"""What to do about a draft directory with a partial or corrupt file (``files.check_model_files``)."""
NONFINITE_FIX = (
    "Its training diverged and it cannot draft anything; train it again with a lower optim.lr (training stops at "
    "its first non-finite step, keeping the last good checkpoint), or use an earlier draft"
)
"""What to do about a draft with an infinite or NaN weight (``files.check_finite``)."""


def draft_dir_of(path: str | Path) -> Path:
    """The draft directory ``path`` names: itself (it holds config.json), or ``RUN/draft`` for a ``draftsmith
    train`` run directory. The one rule ``--draft``, export, publish and the report lookup all use."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / RUN_DRAFT / "config.json").is_file():
        return path / RUN_DRAFT
    return path


def read_draft_config(draft_dir: str | Path) -> dict:
    """A draft directory's ``config.json`` after checking every file in it is whole (``check_model_files``):
    a cut-short copy or malformed JSON is one error naming the file, before anything loads from it."""
    draft_dir = Path(draft_dir)
    files.check_model_files(draft_dir, DRAFT_FIX)
    config = draft_dir / "config.json"
    return files.read_json(config, DRAFT_FIX) if config.is_file() else {}


def check_is_draft(folder: str | Path, config: dict, what: str = "--draft") -> None:
    """Refuse a folder whose ``config.json`` describes no model: neither a draft draftsmith saved (it names
    its kind), nor another pipeline's EAGLE head or DFlash draft, nor a transformers model (a causal LM runs
    as an independent draft). One error naming what is missing, instead of a card or a load of nothing."""
    described = DRAFT_KIND_KEY in config or "model_type" in config
    if described or is_foreign_eagle(config) or is_foreign_dflash(config):
        return
    raise ValueError(
        f"{what} {folder} is not a draft: its config.json names no {DRAFT_KIND_KEY} (a draft `draftsmith train` "
        "saved) and no model_type (a transformers model). Pass a `draftsmith train` run directory, its draft/ "
        "directory, or a model directory"
    )


def check_draft_files(spec: str) -> None:
    """Refuse a ``--draft`` that names a local draft (or run) directory with a partial or corrupt file, one
    that holds no draft (``check_is_draft``) or a non-finite weight, before a target loads for it (minutes for
    a real one); a training-free spec or a Hub id is checked when built."""
    if Path(spec).is_dir():
        folder = draft_dir_of(spec)
        check_is_draft(folder, read_draft_config(folder))
        files.check_finite(folder, NONFINITE_FIX)


def kind_of_checkpoint(path: str | Path) -> DraftKind:
    """The kind of the draft saved in directory ``path`` (any causal-LM directory reads as ``distill``)."""
    return kind_of_config(read_draft_config(path))


def check_target(
    saved: dict | None, target: Target, what: str, layer_id_convention: str | None = None
) -> None:
    """Refuse to use a draft (``what``, e.g. "EAGLE-3 head") with a target other than the one it was
    trained for; for a draft that reads the target's layers, also one whose layer ids count otherwise."""
    if not saved:
        raise ValueError(f"this {what} records no target; re-save it with `draftsmith train`")
    if layer_id_convention is not None and layer_id_convention != LAYER_ID_CONVENTION:
        raise ValueError(
            f"the {what} records layer ids in convention {layer_id_convention!r}, but this version uses "
            f"{LAYER_ID_CONVENTION!r}; re-save it with its layer ids converted."
        )
    current = target.record()
    for name in TARGET_FIELDS:
        if saved.get(name) != current.get(name):
            raise ValueError(
                f"the {what} was trained for target {saved.get('name')!r} but the target is {current.get('name')!r}: "
                f"{name} differs ({saved.get(name)!r} vs {current.get(name)!r}). Use it with the target it was "
                f"trained for, or train one for {current.get('name')!r}."
            )


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The token embedded at the slots a draft fills in parallel (DFlash blocks, P-EAGLE): the tokenizer's
    mask, unknown or padding token, else its end of sequence (never the input of a real slot: generation
    stops there)."""
    for name in ("mask_token_id", "unk_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    return vocab_size - 1


def check_mask_token(mask_token_id: int, vocab_size: int) -> int:
    """``draft.options.mask_token_id`` as a token of the target's vocabulary, or why it cannot be one."""
    if not 0 <= int(mask_token_id) < int(vocab_size):
        raise ValueError(
            f"draft.options.mask_token_id {mask_token_id} is not a token of the target's vocabulary "
            f"(0..{vocab_size - 1}): the draft embeds it with the target's embedding table"
        )
    return int(mask_token_id)


def build_drafter(spec: str, target: Target) -> Drafter:
    """Build a drafter from a spec: ``ngram``, ``ngram:N``, ``layers:N``, or a path / Hub id.

    A training-free kind is named by the spec; a directory (a draft directory, or a ``draftsmith
    train`` run directory holding ``draft/``) or a Hub id is built by the kind its ``config.json``
    records, and any other causal LM on the target's tokenizer as an independent draft.
    """
    name, _, arg = spec.partition(":")
    if name in KINDS and not Path(spec).exists():
        kind = draft_kind(name)
        if not kind.family.checkpoint:
            return kind.build(target, arg)
        raise ValueError(
            f"--draft {spec}: a {kind.title} loads from a checkpoint directory saved by `draftsmith train`; pass "
            "the run directory (or its draft/), or a Hub id"
        )
    from draftsmith.hub import resolve_pretrained

    spec = str(draft_dir_of(resolve_pretrained(spec, what="draft")))  # a Hub id: its local snapshot
    if Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        raise FileNotFoundError(
            f"--draft {spec} holds no draft: expected config.json in it (a draft directory) or draft/config.json "
            "(a `draftsmith train` run directory; it appears once the run has validated)"
        )
    config = read_draft_config(spec)
    check_is_draft(spec, config)
    files.check_finite(spec, NONFINITE_FIX)  # a draft whose training diverged drafts nothing
    return kind_of_config(config).build(target, spec)
