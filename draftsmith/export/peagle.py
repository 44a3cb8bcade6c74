"""What the P-EAGLE kind brings to the engines (``drafts/base.KINDS`` names this module): the engines' EAGLE-3
layouts with parallel drafting.

- vLLM: the reference EAGLE-3 folder plus ``mask_token_id`` (``parallel_fields``) and ``mask_hidden`` (``eagle.py``
  carries it for a head that has it), served with ``"parallel_drafting": true``, the whole chain in one forward;
- speculators: a ``PEagleSpeculator`` (speculators' ``PEagleSpeculatorConfig``; vLLM maps it to EAGLE-3 with
  parallel drafting without being told);
- SGLang: SpecForge's ``PEagleDraftModel`` folder, which SpecForge's exporter gives SGLang: the reference
  config (SGLang's layer ids, ``mask_token_id``) with that architecture, the one decoder layer as
  ``layers.0.*`` (SpecForge's names, speculators' too), the token embedding and ``mask_hidden``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import PEAGLE
from draftsmith.drafts.engines import SGLANG, SPECULATORS, VLLM
from draftsmith.export.eagle import (
    check_exportable,
    layer_names,
    read_weights,
    reference_config,
    reference_weights,
    write_folder,
)
from draftsmith.export.engines import CardContext, ExportOptions, architecture_is, checked, register_family
from draftsmith.export.speculators import write_speculators
from draftsmith.export.verify import (
    EXPORT_FIX,
    HEAD_INTS,
    LayoutExtension,
    _check_decoder,
    _check_eagle3_tensors,
    _check_layer_ids,
    is_engine_eagle3,
    verify_eagle3_engine,
    verify_speculators,
)
from draftsmith.export.vllm import serve_section, write_eagle

SGLANG_ARCHITECTURE = "PEagleDraftModel"
"""SpecForge 0.2.0's P-EAGLE class (``modeling/draft/peagle.py``), whose folder its exporter gives SGLang."""
SPECULATORS_ARCHITECTURE = "PEagleSpeculator"
"""speculators' class of a P-EAGLE head (``speculators_model_type`` ``peagle``)."""
SPECULATORS_ALGORITHM = "peagle"
"""speculators' ``speculators_model_type`` of a P-EAGLE head (``PEagleSpeculatorConfig``; vLLM maps it to EAGLE-3
with parallel drafting)."""


def parallel_fields(config: dict) -> dict:
    """The config fields parallel drafting adds to the engines' EAGLE-3 layout: the token embedded at every slot
    drafted in parallel (vLLM raises without it under ``parallel_drafting``)."""
    return {"mask_token_id": int(config["mask_token_id"])}


def check_mask_token(config: dict, vocab_size: int, problems: list[str]) -> None:
    """The export's mask token: there, and a token of the vocabulary (vLLM embeds it at every parallel slot)."""
    mask = config.get("mask_token_id")
    if mask is None:
        problems.append("mask_token_id missing: the token of the parallel slots is unknown")
    elif not (isinstance(mask, int) and 0 <= mask < vocab_size):
        problems.append(f"mask_token_id {mask!r} is not a token id of the vocabulary")


PARALLEL = LayoutExtension(
    check=check_mask_token, shapes=lambda config: {"mask_hidden": (1, 1, 3 * config["target_hidden_size"])}
)
"""What parallel drafting adds to the EAGLE-3 layout, for the verifiers: the mask token, ``mask_hidden``."""


def is_parallel_eagle3(config: dict) -> bool:
    """An engine's EAGLE-3 folder with parallel drafting's field (vLLM's layout of a P-EAGLE head)."""
    return is_engine_eagle3(config) and "mask_token_id" in config


def write_sglang(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """SpecForge's ``PEagleDraftModel`` folder (the module docstring)."""
    check_exportable(ckpt.config, SGLANG.name)
    weights = reference_weights(read_weights(ckpt.draft_dir), ckpt.config, SGLANG.name)
    config = reference_config(
        ckpt.config, SGLANG.name, weights["fc.weight"].dtype, parallel_fields(ckpt.config)
    )
    config |= {"architectures": [SGLANG_ARCHITECTURE], "norm_before_residual": False}
    return write_folder(out, config, layer_names(weights))


def verify_peagle_sglang(folder: Path) -> list[str]:
    """Problems a P-EAGLE export has as SpecForge's ``PEagleDraftModel`` folder (its ``from_pretrained``: a Llama
    config, ``layers.0.*``, ``mask_hidden``), with SGLang's layer ids as for EAGLE-3."""
    config = files.read_json(folder / "config.json", EXPORT_FIX)
    problems: list[str] = []
    _check_decoder(config, "", problems)
    for key in HEAD_INTS:
        if not isinstance(config.get(key), int):
            problems.append(
                f"config field {key} missing or not an integer: the loader would fall back to a default"
            )
    if config.get("norm_before_residual") is not False:
        problems.append(
            "norm_before_residual must be false: the residual is the fused feature before hidden_norm"
        )
    _check_layer_ids(config, SGLANG.name, problems)
    check_mask_token(config, config.get("vocab_size") or 0, problems)
    if any(p.startswith("config field") for p in problems):
        return problems
    _check_eagle3_tensors(folder, config, SGLANG.name, problems, layer="layers.0.", extension=PARALLEL)
    return problems


def vllm_usage(card: CardContext) -> list[str]:
    """vLLM's parallel drafting: the whole chain in one forward."""
    k = card.config.get("parallel_depths") or card.k
    return serve_section(card, '"method": "eagle3", "parallel_drafting": true', k)


register_family(
    PEAGLE, VLLM, partial(write_eagle, fields=parallel_fields), vllm_usage,
    verifier=(is_parallel_eagle3,
              checked("P-EAGLE head", partial(verify_eagle3_engine, engine=VLLM.name, extension=PARALLEL))),
    help="P-EAGLE: EAGLE-3's layout plus mask_hidden and mask_token_id, served with parallel_drafting",
)  # fmt: skip
register_family(
    PEAGLE, SPECULATORS,
    partial(write_speculators, architecture=SPECULATORS_ARCHITECTURE, algorithm=SPECULATORS_ALGORITHM,
            fields=parallel_fields),
    verifier=(lambda config: config.get("speculators_model_type") == SPECULATORS_ALGORITHM,
              checked("P-EAGLE head (speculators format)",
                      partial(verify_speculators, algorithm=SPECULATORS_ALGORITHM, extension=PARALLEL))),
    help=f"P-EAGLE: {SPECULATORS_ARCHITECTURE}",
)  # fmt: skip
register_family(
    PEAGLE, SGLANG, write_sglang,
    verifier=(architecture_is(SGLANG_ARCHITECTURE), checked("P-EAGLE head", verify_peagle_sglang)),
    help=f"P-EAGLE: SpecForge's {SGLANG_ARCHITECTURE} folder",
)  # fmt: skip
