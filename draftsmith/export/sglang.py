"""The ``sglang`` engine's work: EAGLE-3 heads in the reference layout with SGLang's layer ids
(``eagle.py``), distilled drafts as their transformers directory (SGLang's ``STANDALONE`` drafting).
P-EAGLE heads go as SpecForge's ``PEagleDraftModel`` folder, which SpecForge's exporter sends to SGLang. A
kind with a layout of its own registers it here from its export module (``drafts/base.KINDS``). SGLang
itself does not run here: SpecForge's own classes judge the layouts (tests/test_peagle.py,
tests/test_dflash_peers.py)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import SGLANG
from draftsmith.export import copy_export
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


def verify(folder: Path) -> tuple[str, list[str]]:
    """A P-EAGLE head as SpecForge's folder, anything else as the reference engines' exports (a family of its
    own registers its own check: ``Engine.verifiers``)."""
    architectures = read_export_config(folder).get("architectures")
    if architectures == [PEAGLE_ARCHITECTURE]:
        return "P-EAGLE head", verify_peagle_sglang(folder)
    return verify_reference_engine(folder, SGLANG)


SGLANG.writers.update({"eagle": write_eagle, "causal_lm": copy_export})
SGLANG.verify, SGLANG.usage = verify, usage
