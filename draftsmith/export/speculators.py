"""EAGLE-3 heads in the speculators format (``Eagle3Speculator``), the layout vLLM's docs point to (a kind with a speculators layout of its own registers it from its export module,
``drafts/base.KINDS``).

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
from draftsmith.drafts.engines import SPECULATORS
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
    verify_speculators,
)

ARCHITECTURE = "Eagle3Speculator"
ALGORITHM = "eagle3"
"""``speculators_model_type`` and ``algorithm`` of an EAGLE-3 head: speculators' name for it."""
SCHEMA_VERSION = "0.9.0"
"""The speculators release whose ``Eagle3SpeculatorConfig`` this layout follows."""
SPECULATIVE_TOKENS = 5


def verifier_record(target: dict) -> dict:
    """``speculators_config.verifier``: the target's Hub id (vLLM's auto-detection loads it) and class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.hub import hub_id_of_target

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(target.get("model_type"))
    return {"name_or_path": hub_id_of_target(target), "architectures": [arch] if arch else []}


def speculators_config(
    config: dict,
    dtype: torch.dtype,
    source: dict,
    architecture: str = ARCHITECTURE,
    algorithm: str = ALGORITHM,
    extra: dict | None = None,
) -> dict:
    """config.json of an ``Eagle3Speculator`` checkpoint for the EAGLE head ``config`` (its config.json); a
    family that speculators stores under another class passes its ``architecture`` and ``algorithm``, and the
    fields it adds top-level (``extra``)."""
    target = config["target"]
    return {
        "architectures": [architecture],
        "speculators_model_type": algorithm,
        "speculators_version": SCHEMA_VERSION,
        **(extra or {}),
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


def write_speculators(
    ckpt: DraftCheckpoint,
    out: Path,
    options: ExportOptions,
    architecture: str = ARCHITECTURE,
    algorithm: str = ALGORITHM,
    fields=None,
) -> Path:
    """The EAGLE head ``ckpt`` as an ``Eagle3Speculator`` folder (or the ``architecture``, ``algorithm`` and
    config ``fields`` of the head's config a family passes: ``speculators_config``)."""
    check_exportable(ckpt.config, SPECULATORS.name)
    weights = reference_weights(read_weights(ckpt.draft_dir), ckpt.config, SPECULATORS.name)
    source = source_record(ckpt.config, SPECULATORS.name)
    extra = fields(ckpt.config) if fields else None
    config = speculators_config(
        ckpt.config, weights["fc.weight"].dtype, source, architecture, algorithm, extra
    )
    return write_folder(out, config, layer_names(weights))


def verify(folder: Path) -> tuple[str, list[str]]:
    """An EAGLE-3 head (a family of its own registers its own check: ``Engine.verifiers``)."""
    return "EAGLE-3 head (speculators format)", verify_speculators(folder)


def usage(card: CardContext) -> list[str]:
    return [
        f"vLLM also reads the speculators format: `draftsmith export {card.repo_id} --to speculators`.",
        "",
    ]


SPECULATORS.writers["eagle"] = write_speculators
SPECULATORS.verify, SPECULATORS.usage = verify, usage
