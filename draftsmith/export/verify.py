"""Check an exported folder against what the engine's loader reads; refuse what it would skip or guess.

The expectations are written down here from the loaders' source (versions in docs/EXPORT.md), not
derived from the exporter, so a mistake in the exporter shows up as a failed check:

- EAGLE-3 for vLLM / SGLang: the exact weight names and shapes ``load_weights`` maps (a name it does
  not know crashes vLLM and is silently skipped by SGLang), every config field the model is built
  from (one left out is filled with a default: a guess), the auxiliary layer ids in that engine's
  convention, and ``d2t`` as offsets that agree with ``t2d``.
- draftsmith's transformers layout (``hf``): the check of the draft's family (``Family.verify_hf``, in its
  kind's file: a strict ``from_pretrained`` with the draft's vocabulary against its target's for EAGLE heads,
  Medusa heads and distilled drafts; the generic check for a family that brings none); for vLLM and
  SGLang, a distilled draft's architecture and adapter, then that same check.
- GGUF: see ``draftsmith.export.gguf_verify.verify_gguf``.

A family that extends an engine's EAGLE-3 layout with fields and tensors of its own (parallel drafting) checks
them through a ``LayoutExtension`` its export module passes; nothing here recognises a family by its fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith import files
from draftsmith.drafts.distill import CAUSAL_LM
from draftsmith.drafts.eagle_parts import check_vocab_maps
from draftsmith.drafts.engines import SGLANG, SPECULATORS, VLLM, Engine
from draftsmith.export.engines import engine_of, verifier_of

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EXPORT_FIX = "Export it again from its checkpoint (`draftsmith export CKPT --to ENGINE --overwrite`)"
DECODER_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "max_position_embeddings",
    "vocab_size",
)
"""Integer fields of the head's decoder layer the loaders build it from."""
HEAD_INTS = ("target_hidden_size", "draft_vocab_size")
SPECULATORS_ALGORITHM = "eagle3"
"""``speculators_model_type`` of an EAGLE-3 head in speculators' own config (vLLM reads it)."""

# Causal-LM architectures both engines register as draft models (vLLM models/registry.py
# _TEXT_GENERATION_MODELS, SGLang models/*.py EntryClass), for the tiny families draftsmith tests.
_CAUSAL_LM_DRAFTS = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
    }
)
DRAFT_ARCHITECTURES = {VLLM.name: _CAUSAL_LM_DRAFTS, SGLANG.name: _CAUSAL_LM_DRAFTS}


class ExportVerificationError(ValueError):
    """The folder is not what the engine's loader reads; the message lists every problem."""


@dataclass(frozen=True)
class LayoutExtension:
    """What a family adds to an engine's EAGLE-3 layout, for the checks of it (the plain layout adds nothing)."""

    check: Callable[[dict, int, list[str]], None] = lambda config, vocab_size, problems: None
    """``(config.json, the vocabulary size, problems)``: append the problems of the fields it adds."""
    shapes: Callable[[dict], dict[str, tuple[int, ...]]] = lambda config: {}
    """The tensors it adds and their shapes, from the head's fields (``target_hidden_size``, ...)."""


PLAIN = LayoutExtension()
"""The EAGLE-3 layout as the engine's loader reads an EAGLE-3 head."""


def _eagle3_expected_shapes(
    c: dict, engine: str, layer: str = "midlayer.", extension: LayoutExtension = PLAIN
) -> dict[str, tuple[int, ...]]:
    """Weight name -> shape, as vLLM's / SGLang's llama_eagle3.py load_weights maps them.

    vLLM has a ``draft_id_to_target_id`` parameter for ``d2t`` only when ``draft_vocab_size`` differs
    from the target's vocabulary, and raises on a ``d2t`` it has no parameter for; SGLang always reads one.
    """
    H, Ht, ffn = c["hidden_size"], c["target_hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {
        "embed_tokens.weight": (c["vocab_size"], H),
        "fc.weight": (H, 3 * Ht),
        "norm.weight": (H,),
        "lm_head.weight": (c["draft_vocab_size"], H),
    }
    shapes |= {
        layer + name: shape
        for name, shape in {
            "input_layernorm.weight": (H,),
            "hidden_norm.weight": (H,),
            "post_attention_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (q, 2 * H),
            "self_attn.k_proj.weight": (kv, 2 * H),
            "self_attn.v_proj.weight": (kv, 2 * H),
            "self_attn.o_proj.weight": (H, q),
            "mlp.gate_proj.weight": (ffn, H),
            "mlp.up_proj.weight": (ffn, H),
            "mlp.down_proj.weight": (H, ffn),
        }.items()
    }
    if engine == SGLANG.name or c["draft_vocab_size"] != c["vocab_size"]:
        shapes |= {"d2t": (c["draft_vocab_size"],), "t2d": (c["vocab_size"],)}
    if engine == VLLM.name and c.get("norm_before_fc"):  # vLLM's input_norm, one RMSNorm over fc's input
        shapes["input_norm.weight"] = (3 * Ht,)
    return shapes | extension.shapes(c)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    paths = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in paths:
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _check_layer_ids(config: dict, engine: str, problems: list[str]) -> None:
    """The aux layer ids sit where ``engine`` reads them, in its convention, ascending, within the target."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if engine in (VLLM.name, SPECULATORS.name):
        ids, where, shift = top, "eagle_aux_hidden_state_layer_ids", 1
        if nested is not None:
            problems.append(
                "eagle_config.eagle_aux_hidden_state_layer_ids is SGLang's field (another convention); vLLM ignores it"
            )
    else:
        ids, where, shift = nested, "eagle_config.eagle_aux_hidden_state_layer_ids", 0
        if top is not None:
            problems.append("top-level eagle_aux_hidden_state_layer_ids is vLLM's field; SGLang ignores it")
        if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            problems.append(
                "eagle_config.use_aux_hidden_state is false: SGLang would not capture the target layers"
            )
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
        problems.append(
            f"{where} must list 3 integer layer ids (missing: the engine guesses (2, N/2, N-3)); got {ids!r}"
        )
        return
    if ids != sorted(set(ids)):
        problems.append(
            f"{where} {ids} must be distinct and ascending: the engine captures each layer once and concatenates "
            "the states in ascending layer order, so fc's columns must follow that order"
        )
    source = config.get("draftsmith_source") or {}
    n_layers = (source.get("target") or {}).get("num_hidden_layers")
    if n_layers is not None:
        last = (
            n_layers - 1 if engine in (VLLM.name, SPECULATORS.name) else n_layers - 2
        )  # vLLM also captures after its loop
        lo, hi = shift, last + shift
        bad = [i for i in ids if not lo <= i <= hi]
        if bad:
            problems.append(
                f"{where} {bad} outside {lo}..{hi}: a {n_layers}-layer target never captures them"
            )
    trained = source.get("capture_layer_ids")
    if trained is None:
        problems.append(
            "draftsmith_source.capture_layer_ids missing: cannot check the layer ids against the head's"
        )
    elif [i + shift for i in trained] != ids:
        problems.append(
            f"{where} is {ids} but the head was trained on layer outputs {trained} (draftsmith convention), which "
            f"{engine} spells {[i + shift for i in trained]}"
        )


def verify_eagle3_engine(folder: Path, engine: str, extension: LayoutExtension = PLAIN) -> list[str]:
    """Problems an EAGLE-3 export for vLLM or SGLang has (empty list = loads as trained), with what a family's
    ``extension`` adds to the layout."""
    config = files.read_json(folder / "config.json", EXPORT_FIX)
    problems: list[str] = []
    if config.get("architectures") != [EAGLE3_ARCHITECTURE]:
        problems.append(
            f"architectures must be [{EAGLE3_ARCHITECTURE!r}], got {config.get('architectures')!r}"
        )
    _check_decoder(config, "", problems)
    for key in HEAD_INTS:
        if not isinstance(config.get(key), int):
            problems.append(
                f"config field {key} missing or not an integer: the loader would fall back to a default"
            )
    if engine == VLLM.name:
        trained = (config.get("draftsmith_source") or {}).get("norms") or {}
        written = {"norm_before_fc": False, "norm_output": False} | config  # vLLM's defaults of these two
        for key in ("norm_before_residual", "norm_before_fc", "norm_output"):
            if written.get(key) is not bool(trained.get(key)):
                problems.append(
                    f"{key} must be written as {str(bool(trained.get(key))).lower()} (the head was trained "
                    f"{'with' if trained.get(key) else 'without'} it; vLLM reads a missing one as its own default)"
                )
    elif config.get("norm_before_fc") or config.get("norm_output"):
        problems.append(
            f"{engine}'s EAGLE-3 loader reads no norm_before_fc or norm_output; this export sets one"
        )
    _check_layer_ids(config, engine, problems)
    extension.check(config, config.get("vocab_size") or 0, problems)
    if any(p.startswith("config field") for p in problems):
        return problems
    tensors = _read_tensors(folder)
    if not tensors:
        return problems + ["no *.safetensors weights"]
    _check_eagle3_tensors(folder, config, engine, problems, extension=extension)
    return problems


def _check_decoder(c: dict, where: str, problems: list[str]) -> None:
    """The head's decoder layer as the loaders build it: Llama, one layer, every size given, no biases."""
    if c.get("model_type") != "llama":
        problems.append(
            f"{where}model_type must be 'llama' (the draft config class), got {c.get('model_type')!r}"
        )
    for key in DECODER_INTS:
        if not isinstance(c.get(key), int):
            problems.append(
                f"config field {where}{key} missing or not an integer: the loader would fall back to a default"
            )
    if c.get("num_hidden_layers") != 1:
        problems.append(f"{where}num_hidden_layers must be 1 (one midlayer)")
    for key in ("rms_norm_eps", "rope_theta"):
        if not isinstance(c.get(key), (int, float)):
            problems.append(f"config field {where}{key} missing: the loader would use the Llama default")
    if c.get("hidden_act") != "silu":
        problems.append(f"{where}hidden_act must be 'silu', got {c.get('hidden_act')!r}")
    if c.get("tie_word_embeddings") is not False:
        problems.append(
            f"{where}tie_word_embeddings must be false (SGLang would read the draft vocabulary off the embeddings)"
        )
    for key in ("attention_bias", "mlp_bias", "bias"):
        if c.get(key):
            problems.append(f"{where}{key} is true, but the head has no biases")


def _check_eagle3_tensors(
    folder: Path,
    config: dict,
    engine: str,
    problems: list[str],
    layer: str = "midlayer.",
    extension: LayoutExtension = PLAIN,
) -> None:
    """Exactly the tensors the loader maps, with their shapes, one float dtype and consistent vocab maps."""
    tensors = _read_tensors(folder)
    if not tensors:
        problems.append("no *.safetensors weights")
        return
    expected = _eagle3_expected_shapes(config, engine, layer, extension)
    for name in sorted(set(expected) - set(tensors)):
        problems.append(f"weight {name} missing")
    for name in sorted(set(tensors) - set(expected)):
        why = (
            "vLLM creates no draft_id_to_target_id for a full draft vocabulary and its loader raises on d2t"
            if name == "d2t"
            else "vLLM fails on it, SGLang skips it"
        )
        problems.append(f"weight {name} is not one the {engine} loader maps ({why})")
    for name in sorted(set(expected) & set(tensors)):
        if tuple(tensors[name].shape) != expected[name]:
            problems.append(
                f"weight {name} has shape {tuple(tensors[name].shape)}, expected {expected[name]}"
            )
    floats = {str(t.dtype) for n, t in tensors.items() if n not in ("d2t", "t2d")}
    if len(floats) > 1:
        problems.append(f"weights mix dtypes {sorted(floats)}")
    if "d2t" in tensors and "t2d" in tensors and not any("d2t" in p or "t2d" in p for p in problems):
        check_vocab_maps(tensors["d2t"], tensors["t2d"], config["vocab_size"], True, problems)


def verify_speculators(
    folder: Path, algorithm: str = SPECULATORS_ALGORITHM, extension: LayoutExtension = PLAIN
) -> list[str]:
    """Problems an ``Eagle3Speculator`` export has for vLLM's speculators reader (configs/speculators), or a
    family's speculators class stored that way (its ``algorithm``, its ``extension`` of the layout)."""
    config = files.read_json(folder / "config.json", EXPORT_FIX)
    problems: list[str] = []
    if config.get("speculators_model_type") != algorithm:
        problems.append(
            f"speculators_model_type must be {algorithm!r}, got {config.get('speculators_model_type')!r}"
        )
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    if not isinstance(methods[0].get("speculative_tokens"), int):
        problems.append(
            "speculators_config.proposal_methods[0].speculative_tokens missing (vLLM requires it)"
        )
    if "name_or_path" not in (spec.get("verifier") or {}):
        problems.append("speculators_config.verifier.name_or_path missing (vLLM requires it)")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return problems + ["transformer_layer_config missing: vLLM builds the draft decoder from it"]
    _check_decoder(layer, "transformer_layer_config.", problems)
    for key in HEAD_INTS:
        if not isinstance(config.get(key), int):
            problems.append(f"config field {key} missing or not an integer: vLLM would use a default")
    if config.get("norm_before_residual") is not False:
        problems.append(
            "norm_before_residual must be written as false: vLLM assumes true when it is missing, and the "
            "head's residual is the fused feature before hidden_norm"
        )
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        if config.get(key):
            problems.append(f"{key} is true, but the head has no such norm")
    _check_layer_ids(config, SPECULATORS.name, problems)
    extension.check(config, layer.get("vocab_size") or 0, problems)
    if any(p.startswith("config field") for p in problems):
        return problems
    flat = {**{k: layer[k] for k in DECODER_INTS}, **{k: config[k] for k in HEAD_INTS}}
    _check_eagle3_tensors(folder, flat, SPECULATORS.name, problems, layer="layers.0.", extension=extension)
    return problems


def verify_causal_lm(folder: Path, engine: str) -> list[str]:
    """Problems a distilled draft folder has for vLLM or SGLang as a draft model: an architecture the engine
    registers, no LoRA adapter beside the weights, then the transformers checks (``drafts/distill.py``)."""
    config = files.read_json(folder / "config.json", EXPORT_FIX)
    problems: list[str] = []
    arch = (config.get("architectures") or [None])[0]
    if not list(folder.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    if engine in DRAFT_ARCHITECTURES and arch not in DRAFT_ARCHITECTURES[engine]:
        problems.append(f"architecture {arch!r} is not one {engine} loads as a draft model here")
    if (folder / "adapter_config.json").exists():
        problems.append(
            f"a LoRA adapter is stored beside the base weights; {engine} would skip it (save with merge)"
        )
    return problems or CAUSAL_LM.verify_hf(folder)


def read_export_config(folder: Path) -> dict:
    """An export folder's config.json after checking every file in it is whole (a cut-short copy: one line
    naming the file); a folder without one is not an export."""
    if not (folder / "config.json").is_file():
        raise ExportVerificationError(f"{folder} has no config.json; it is not an export")
    files.check_model_files(folder, EXPORT_FIX)
    return files.read_json(folder / "config.json", EXPORT_FIX)


def is_engine_eagle3(config: dict) -> bool:
    """An EAGLE-3 head in an engine's layout (vLLM, SGLang), not draftsmith's own: its architecture, or the
    source record an EAGLE export carries (it names the engine; other families' records name their kind)."""
    source = config.get("draftsmith_source")
    return config.get("architectures") == [EAGLE3_ARCHITECTURE] or (
        isinstance(source, dict) and "engine" in source
    )


def verify_hf(folder: Path) -> tuple[str, list[str]]:
    """draftsmith's transformers layout of any kind, by its family's check (``Family.verify_hf``)."""
    from draftsmith.drafts.base import kind_of_config

    config = read_export_config(folder)
    if is_engine_eagle3(config):
        return "EAGLE-3 head", [
            f"{folder} is an engine-layout EAGLE-3 export; export with --to hf for transformers"
        ]
    kind = kind_of_config(config)
    return kind.title, kind.family.verify_hf(folder)


def verify_reference_engine(folder: Path, engine: Engine) -> tuple[str, list[str]]:
    """An engine that reads the reference EAGLE-3 layout or a causal LM's transformers directory (vLLM, SGLang)."""
    from draftsmith.drafts.base import kind_of_config

    config = read_export_config(folder)
    if is_engine_eagle3(config):
        return "EAGLE-3 head", verify_eagle3_engine(folder, engine.name)
    source = config.get("draftsmith_source")
    if (
        isinstance(source, dict) and "kind" in source
    ):  # a family's own layout no check of this engine recognised
        return str(source["kind"]), [
            f"{folder} is draftsmith's {source['kind']} export for another engine: {engine.name} has no loader "
            f"for it; export it with --to {engine.name}"
        ]
    kind = kind_of_config(config)
    if kind.family is CAUSAL_LM:
        return kind.title, verify_causal_lm(folder, engine.name)
    return kind.title, [
        f"{folder} is draftsmith's transformers layout of a {kind.title}, not {engine.name}'s; export it with "
        f"--to {engine.name}"
    ]


def verify_export(folder: str | Path, engine: str | Engine) -> list[str]:
    """Check ``folder`` as an export for ``engine`` (its name or record) with the engine's verifier; return
    what was checked, raise with every problem."""
    folder, record = Path(folder), engine_of(engine)
    config = read_export_config(folder) if folder.is_dir() and (folder / "config.json").is_file() else {}
    verify = verifier_of(record, config)
    if verify is None:
        raise ValueError(f"the {record.name} engine registers no verifier; nothing checks its exports")
    what, problems = verify(folder)
    if problems:
        raise ExportVerificationError(
            f"{folder} is not a valid {record.name} export:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return [f"{what} in {folder} matches what the {record.name} loader reads"]
