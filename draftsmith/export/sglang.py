"""The ``sglang`` engine's work: EAGLE-3 heads in the reference layout with SGLang's layer ids
(``eagle.py``), distilled drafts as their transformers directory (SGLang's ``STANDALONE`` drafting), DFlash
drafts as SpecForge's ``DFlashDraftModel`` folder (SpecForge 0.2.0's exporter sends SGLang users to that
layout, its ``export --to hf``; vLLM's loader reads the same, so it is ``export/dflash.py``'s vLLM writer).
P-EAGLE heads go as SpecForge's ``PEagleDraftModel`` folder, which the same exporter sends to SGLang. SGLang
itself does not run here: both layouts are judged by SpecForge's own classes (tests/test_dflash_peers.py,
tests/test_peagle.py)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import DFLASH
from draftsmith.drafts.engines import SGLANG
from draftsmith.drafts.taps import refuse_uncaptured_last_layer
from draftsmith.export import copy_export
from draftsmith.export.dflash import DFLASH_ARCHITECTURE, verify_dflash_vllm, write_vllm
from draftsmith.export.eagle import (
    check_exportable,
    export_eagle,
    layer_names,
    read_weights,
    reference_config,
    reference_weights,
    write_folder,
)
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.verify import read_export_config, verify_peagle_sglang, verify_reference_engine

PEAGLE_ARCHITECTURE = "PEagleDraftModel"
"""SpecForge 0.2.0's P-EAGLE class (``modeling/draft/peagle.py``), whose folder its exporter gives SGLang."""


def write_eagle(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """An EAGLE-3 head in the reference layout; a P-EAGLE head as SpecForge's ``PEagleDraftModel`` folder: the
    reference config (SGLang's layer ids, ``mask_token_id``) with that architecture, the one decoder layer as
    ``layers.0.*`` (SpecForge's names, speculators' too), the token embedding and ``mask_hidden``."""
    if ckpt.config.get("mask_token_id") is None:
        return export_eagle(ckpt, out, SGLANG.name)
    check_exportable(ckpt.config, SGLANG.name)
    weights = reference_weights(read_weights(ckpt.draft_dir), ckpt.config, SGLANG.name)
    config = reference_config(ckpt.config, SGLANG.name, weights["fc.weight"].dtype)
    config |= {"architectures": [PEAGLE_ARCHITECTURE], "norm_before_residual": False}
    return write_folder(out, config, layer_names(weights))


def usage(card: CardContext) -> list[str]:
    base, repo, k = card.base_model, card.repo_id, card.k
    if card.kind.family.name == DFLASH:  # not run here: no command draftsmith has not seen work
        return [
            "### SGLang",
            "",
            f"`draftsmith export {repo} --to sglang --out draft-sglang` writes SpecForge's `DFlashDraftModel` "
            "folder, the layout SpecForge's exporter gives SGLang; serve it as SGLang's DFlash documentation says "
            f"(a block drafts {int(card.config.get('block_size', 2)) - 1} tokens).",
            "",
        ]
    if card.kind.family.name == "causal_lm":
        algorithm, draft, export, note = "STANDALONE", repo, [], []
    else:
        algorithm, draft = "EAGLE3", "draft-sglang"
        export = [f"draftsmith export {repo} --to sglang --out draft-sglang"]
        note = [
            "vLLM and SGLang read the head's target layers from different fields and count them differently; "
            "see draftsmith's docs/EXPORT.md.",
            "",
        ]
    return [
        "### SGLang",
        "",
        "```bash",
        *export,
        f"python -m sglang.launch_server --model {base} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {draft} --speculative-num-steps {k} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {k + 1}",
        "```",
        "",
        *note,
    ]


def write_dflash(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """vLLM's ``DFlashDraftModel`` folder, refused for a draft that reads the target's last layer (SGLang marks
    ``layers[id + 1]`` to capture, and a target has no layer L)."""
    refuse_uncaptured_last_layer(
        list(ckpt.config.get("capture_layer_ids") or []), int(ckpt.target.get("num_hidden_layers", 0)), SGLANG
    )
    return write_vllm(ckpt, out, options)


def verify(folder: Path) -> tuple[str, list[str]]:
    """A DFlash draft by vLLM's checks (the same ``DFlashDraftModel`` folder), anything else as the reference
    engines' exports."""
    architectures = read_export_config(folder).get("architectures")
    if architectures == [DFLASH_ARCHITECTURE]:
        return "DFlash draft", verify_dflash_vllm(folder)
    if architectures == [PEAGLE_ARCHITECTURE]:
        return "P-EAGLE head", verify_peagle_sglang(folder)
    return verify_reference_engine(folder, SGLANG)


SGLANG.writers.update({"eagle": write_eagle, "causal_lm": copy_export, DFLASH: write_dflash})
SGLANG.verify, SGLANG.usage = verify, usage
