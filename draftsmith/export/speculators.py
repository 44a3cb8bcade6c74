"""EAGLE-3 and P-EAGLE heads in the speculators format (``Eagle3Speculator``, ``PEagleSpeculator``), the
layout vLLM's docs point to; DFlash drafts as ``DFlashSpeculator`` (their tensors and checks are
``export/dflash.py``'s for vLLM).

vLLM reads it through ``vllm/transformers_utils/configs/speculators`` (docs/EXPORT.md gives the
version and what it reads): the decoder shape comes from ``transformer_layer_config``, and
``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual`` and the top-level
``eagle_aux_hidden_state_layer_ids`` (vLLM's convention: id L = the input of target layer L) from the
top level. ``norm_before_residual`` is always written: vLLM assumes ``true`` when it is missing,
speculators' own default is ``false``, and draftsmith's head is ``false`` (its residual is the fused
feature before ``hidden_norm``). Tensors are named ``layers.0.*`` (not the reference ``midlayer.*``);
``d2t`` (offsets) and ``t2d`` only when the draft vocabulary is smaller than the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import DFLASH
from draftsmith.drafts.engines import SPECULATORS
from draftsmith.export.dflash import DFLASH_ARCHITECTURE, check_dflash_config, engine_tensors, vllm_config
from draftsmith.export.dflash import write_folder as write_dflash_folder
from draftsmith.export.eagle import (
    SOURCE_KEY,
    check_exportable,
    decoder_fields,
    engine_layer_ids,
    layer_names,
    read_weights,
    reference_weights,
    source_record,
    write_folder,
)
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.verify import (
    SPECULATORS_PARALLEL_ALGORITHM,
    _read_tensors,
    read_export_config,
    verify_speculators,
)

ARCHITECTURE = "Eagle3Speculator"
ALGORITHM = "eagle3"
"""``speculators_model_type`` and ``algorithm`` of an EAGLE-3 head: speculators' name for it."""
PARALLEL_ARCHITECTURE, PARALLEL_ALGORITHM = "PEagleSpeculator", SPECULATORS_PARALLEL_ALGORITHM
"""The same for a P-EAGLE head (speculators' ``PEagleSpeculatorConfig``; vLLM maps it to EAGLE-3 with
``parallel_drafting``)."""
SCHEMA_VERSION = "0.9.0"
"""The speculators release whose ``Eagle3SpeculatorConfig`` this layout follows."""
SPECULATIVE_TOKENS = 5


def verifier_record(target: dict) -> dict:
    """``speculators_config.verifier``: the target's Hub id (vLLM's auto-detection loads it) and class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.hub import hub_id_of_target

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(target.get("model_type"))
    return {"name_or_path": hub_id_of_target(target), "architectures": [arch] if arch else []}


def speculators_config(config: dict, dtype: torch.dtype, source: dict) -> dict:
    """config.json of an ``Eagle3Speculator`` checkpoint for the EAGLE-3 head ``config`` (its config.json), or
    of a ``PEagleSpeculator`` for a P-EAGLE head (vLLM then drafts in parallel without being told)."""
    target = config["target"]
    parallel = config.get("mask_token_id") is not None
    algorithm, architecture = (
        (PARALLEL_ALGORITHM, PARALLEL_ARCHITECTURE) if parallel else (ALGORITHM, ARCHITECTURE)
    )
    extra = {"mask_token_id": int(config["mask_token_id"])} if parallel else {}
    return {
        "architectures": [architecture],
        "speculators_model_type": algorithm,
        "speculators_version": SCHEMA_VERSION,
        **extra,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(config.get("parallel_depths") or SPECULATIVE_TOKENS),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier_record(target),
        },
        "transformer_layer_config": decoder_fields(config),
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": target["hidden_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": engine_layer_ids(
            sorted(config["capture_layer_ids"]), SPECULATORS.name
        ),
        "torch_dtype": str(dtype).removeprefix("torch."),
        SOURCE_KEY: source,
    }


def write_speculators(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """The EAGLE head ``ckpt`` as an ``Eagle3Speculator`` folder."""
    check_exportable(ckpt.config, SPECULATORS.name)
    weights = reference_weights(read_weights(ckpt.draft_dir), ckpt.config, SPECULATORS.name)
    source = source_record(ckpt.config, SPECULATORS.name)
    config = speculators_config(ckpt.config, weights["fc.weight"].dtype, source)
    return write_folder(out, config, layer_names(weights))


DFLASH_TYPE = "dflash"
"""``speculators_model_type`` of a DFlash draft in speculators 0.9.0 (``DFlashSpeculatorConfig``)."""


def dflash_speculators_config(config: dict, verifier: dict) -> dict:
    """speculators 0.9.0's ``DFlashSpeculatorConfig`` for a draftsmith DFlash config: the decoder in
    ``transformer_layer_config``, the taps as ``aux_hidden_state_layer_ids`` in vLLM's convention (input of
    layer L = draftsmith's output of layer L - 1), the block and mask token top-level; what vLLM's
    ``update_dflash`` turns into ``dflash_config`` when the speculator is served."""
    layer = {key: value for key, value in vllm_config(config, 0).items()
             if key not in ("architectures", "dflash_config", "num_target_layers", "block_size", "torch_dtype",
                            "draft_vocab_size")}  # fmt: skip
    block = int(config["block_size"])
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": DFLASH_TYPE,
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": DFLASH_TYPE,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],  # fmt: skip
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"]),
        "target_hidden_size": int(config["target"]["hidden_size"]),
        "block_size": block,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in config["capture_layer_ids"]],
        "mask_token_id": int(config["mask_token_id"]),
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "torch_dtype": "float32",
    }


def write_dflash_speculators(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """The DFlash draft as a speculators ``DFlashSpeculator`` folder (vLLM serves the type as ``dflash``)."""
    config = dflash_speculators_config(ckpt.config, verifier_record(ckpt.target))
    config[SOURCE_KEY] = {"kind": ckpt.kind.name, "target": ckpt.target}
    return write_dflash_folder(out, config, engine_tensors(ckpt))


def verify_dflash_speculators(folder: Path) -> list[str]:
    """Problems a DFlash export has for speculators 0.9.0 and vLLM's reader of it (``configs/speculators/
    algos.py`` ``update_dflash``): the fields it requires and the tensors of vLLM's DFlash model."""
    config = read_export_config(folder)
    problems = []
    if config.get("speculators_model_type") != DFLASH_TYPE:
        problems.append(
            f"speculators_model_type must be 'dflash', got {config.get('speculators_model_type')!r}"
        )
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    if not isinstance(methods[0].get("speculative_tokens"), int):
        problems.append(
            "speculators_config.proposal_methods[0].speculative_tokens missing (vLLM requires it)"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return problems + ["transformer_layer_config missing: the draft decoder is built from it"]
    ids = config.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or any(b <= a for a, b in zip(ids, ids[1:])) or min(ids) < 1:
        problems.append(
            f"aux_hidden_state_layer_ids {ids!r}: vLLM requires a strictly increasing list of ids >= 1"
        )
    if config.get("sample_from_anchor"):
        problems.append("sample_from_anchor is true: the anchor is the committed token, never drafted")
    # the rest is what vLLM's DFlash model is built from: the same checks as the vllm layout
    flat = {**layer, "architectures": [DFLASH_ARCHITECTURE], "block_size": config.get("block_size"),
            "draft_vocab_size": config.get("draft_vocab_size"),
            "dflash_config": {"mask_token_id": config.get("mask_token_id"),
                              "target_layer_ids": [i - 1 for i in ids or []]}}  # fmt: skip
    return problems + check_dflash_config(flat, _read_tensors(folder))


def verify(folder: Path) -> tuple[str, list[str]]:
    """A DFlash draft by its own checks, anything else as an EAGLE-3 head."""
    config = read_export_config(folder)
    if config.get("speculators_model_type") == DFLASH_TYPE:
        return "DFlash draft (speculators format)", verify_dflash_speculators(folder)
    what = "P-EAGLE head" if config.get("mask_token_id") is not None else "EAGLE-3 head"
    return f"{what} (speculators format)", verify_speculators(folder)


def usage(card: CardContext) -> list[str]:
    return [
        f"vLLM also reads the speculators format: `draftsmith export {card.repo_id} --to speculators`.",
        "",
    ]


SPECULATORS.writers.update({"eagle": write_speculators, DFLASH: write_dflash_speculators})
SPECULATORS.verify, SPECULATORS.usage = verify, usage
