"""DFlash drafts in the speculators format (``DFlashSpeculator``, speculators 0.9.0's ``DFlashSpeculatorConfig``):
the decoder of vLLM's ``DFlashDraftModel`` (``dflash_vllm.py``: its tensors and checks) under speculators'
config, which vLLM's ``configs/speculators/algos.py`` (``update_dflash``) turns into ``dflash_config`` when it
serves the speculator."""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.export.dflash_vllm import (
    DFLASH_ARCHITECTURE,
    check_dflash_config,
    engine_tensors,
    vllm_config,
)
from draftsmith.export.dflash_vllm import write_folder as write_dflash_folder
from draftsmith.export.eagle import SOURCE_KEY
from draftsmith.export.engines import ExportOptions
from draftsmith.export.speculators import verifier_record
from draftsmith.export.verify import _read_tensors, read_export_config

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
