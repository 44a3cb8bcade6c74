"""The engines draftsmith exports to and the peers' layouts it reads: one record each.

An ``Engine`` says who the engine is (its ``--to`` name, its title, the version its layout was checked
against, its line of ``draftsmith export --help``) and which draft families it cannot load, with the
reason. The app layer registers the work onto the record: a writer per draft family (or one for any
family, ``fallback``), a verifier and the
model card's usage snippet (``draftsmith/export/<name>.py``, imported the first time the engine is
used); a peer's layout that draftsmith reads gets its detector from ``drafts/eagle_import.py``.

The records sit here, below the export package, so that a kind's record names the engines it goes to
by record (``exports=(HF,)``) without importing the app layer. Adding an engine = its record (here, or
in its own module) and its writer module; help, dispatch, verification and the card read the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.spelling import closest

Writer = Callable[..., Path]
"""``(checkpoint, out, options) -> the folder or file written`` (``draftsmith.export.ExportOptions``)."""
Verifier = Callable[[Path], tuple[str, list[str]]]
"""``export -> (what it holds, problems)``; no problems = the engine's loader reads it as trained."""
Usage = Callable[..., list[str]]
"""``(card context) -> the model card's Markdown lines for this engine`` (empty: no section)."""
Detector = Callable[[dict, dict], bool]
"""``(config.json, tensors) -> whether a head directory is in this layout`` (layouts draftsmith reads)."""
Recognise = Callable[[dict], bool]
"""``export's config.json -> whether it is in this family's layout`` (which verifier checks an export)."""


@dataclass(eq=False)
class Engine:
    """One engine or peer layout; its writers, verifier, usage and detector are registered onto it."""

    name: str
    """``--to NAME``; the layout's name in an imported head's ``imported_from`` record."""
    title: str
    """What help, errors and the model card call it ("vLLM")."""
    checked: str
    """The engine release whose loader (or writer) the layout was checked against."""
    help: str = ""
    """What ``--to NAME`` writes of its own accord, for ``draftsmith export --help`` (the kinds registered
    onto it add theirs: ``family_help``); empty for a layout draftsmith only reads."""
    refuses: dict[str, str] = field(default_factory=dict)
    """Draft family -> why the engine cannot load such a draft."""
    file_suffix: str | None = None
    """The export is one file with this suffix (``.gguf``), not a folder."""
    captures_last_layer: bool = True
    """Whether the engine can hand a draft the output of the target's last decoder layer (vLLM captures every
    layer's output; SGLang and llama.cpp capture only layer inputs): ``drafts/taps.py``."""
    family_help: dict[str, str] = field(default_factory=dict)
    """Draft family -> what ``--to NAME`` writes for it, registered with its writer by the kind's export module
    (``draftsmith export --help`` lists them after ``help``)."""
    writers: dict[str, Writer] = field(default_factory=dict)
    """Draft family -> its writer (registered by ``draftsmith/export/<name>.py`` for what the engine serves
    of its own accord, by the kind's export module, ``drafts/base.KINDS``, for the rest)."""
    usages: dict[str, Usage] = field(default_factory=dict)
    """Draft family -> the model card's section for such drafts (registered with the writer); a family
    without one gets the engine's ``usage``."""
    verifiers: dict[str, tuple[Recognise, Verifier]] = field(default_factory=dict)
    """Draft family -> (whether an export's config.json is in its layout, the check of such an export), tried
    before the engine's own ``verify``."""
    fallback: Writer | None = None
    """The writer of any family with a checkpoint that ``writers`` does not name (hf: the family's own
    ``hf_writer``, else the draft directory as it is); None: such a family is refused."""
    verify: Verifier | None = None
    usage: Usage | None = None
    detect: Detector | None = None

    @property
    def exported(self) -> bool:
        """Whether ``draftsmith export --to`` writes it (a layout only read has no help line)."""
        return bool(self.help)

    def __repr__(self) -> str:
        return f"Engine({self.name!r})"


_ENGINES: dict[str, Engine] = {}


def register_engine(engine: Engine) -> Engine:
    """Make an engine known (its module calls this at import); one record per name."""
    if _ENGINES.get(engine.name, engine) is not engine:
        raise ValueError(f"an engine named {engine.name!r} is registered already")
    _ENGINES[engine.name] = engine
    return engine


def export_engines() -> list[Engine]:
    """The engines ``draftsmith export --to`` writes, in the order help and the card list them."""
    return [e for e in _ENGINES.values() if e.exported]


def read_layouts() -> list[Engine]:
    """The layouts of other pipelines' heads draftsmith recognises, in the order they are tried."""
    return [e for e in _ENGINES.values() if e.detect is not None]


def engine_named(name: str) -> Engine:
    """The record of the engine ``--to name`` names; an error naming the closest one otherwise."""
    names = [e.name for e in export_engines()]
    if name not in names:
        close = closest(name, names)
        hint = f" Did you mean {close!r}?" if close else ""
        raise ValueError(f"unknown engine {name!r}.{hint} Choose one of {', '.join(names)}")
    return _ENGINES[name]


HF = register_engine(Engine(
    "hf", "transformers", "transformers 5.24.0 (from_pretrained, assistant_model)",
    help="draftsmith's transformers layout, every kind with a checkpoint (`draftsmith eval --draft DIR`; a "
    "distilled draft is an assistant_model)",
))  # fmt: skip
VLLM = register_engine(Engine("vllm", "vLLM", "vLLM 0.33.0 (llama_eagle3.py, llama.py capture, interfaces.py)",
    help="EAGLE-3: LlamaForCausalLMEagle3, layer ids top-level in vLLM's convention (input of layer L: draftsmith "
    "id + 1), d2t as offsets, none for a full vocabulary; distilled: the transformers directory (draft_model)"))  # fmt: skip
SGLANG = register_engine(Engine("sglang", "SGLang", "SGLang 0.5.23 (llama_eagle3.py, spec_aux_hidden_state.py)",
    captures_last_layer=False,
    help="EAGLE-3: LlamaForCausalLMEagle3, layer ids in eagle_config in SGLang's convention (= draftsmith's: "
    "output of layer i), d2t as offsets; distilled: the transformers directory (STANDALONE)"))  # fmt: skip
SPECULATORS = register_engine(Engine(
    "speculators", "speculators format",
    "speculators 0.9.0 (Eagle3SpeculatorConfig, Eagle3DraftModel.save_pretrained); vLLM 0.33.0 configs/speculators",
    help="EAGLE-3: Eagle3Speculator, the speculators format vLLM's docs point to (vLLM's conventions)",
    refuses={"causal_lm": "the speculators format holds EAGLE-3 heads; a distilled draft is an ordinary causal "
             "LM: export it with --to vllm (vLLM's draft_model method loads the transformers directory)"},
))  # fmt: skip
GGUF = register_engine(Engine(
    "gguf", "llama.cpp", "llama.cpp from the llama-cpp-python 0.3.36 sdist (llama-server, run by the tests)",
    help="one GGUF file for llama.cpp / LM Studio: an EAGLE-3 head in its eagle3 architecture (needs the target's "
    "GGUF, --target-gguf) or a distilled Llama draft",
    file_suffix=".gguf", captures_last_layer=False,
))  # fmt: skip
REFERENCE_EAGLE3 = register_engine(Engine(
    "reference", "reference EAGLE-3 (SafeAILab/EAGLE; SpecForge and SGLang exports)",
    "SafeAILab/EAGLE (yuhuili/EAGLE3-*), SpecForge 0.2.0 export --to sglang",
))  # fmt: skip
MODELOPT = register_engine(
    Engine("modelopt", "NVIDIA ModelOpt export", "nvidia-modelopt 0.47.0 (hf_spec_export.py)")
)
