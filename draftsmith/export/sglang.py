"""The ``sglang`` engine's work: EAGLE-3 heads in the reference layout with SGLang's layer ids
(``eagle.py``), distilled drafts as their transformers directory (SGLang's ``STANDALONE`` drafting). A
kind with a layout of its own registers it here from its export module (``drafts/base.KINDS``). SGLang
itself does not run here: SpecForge's own classes judge the layouts (tests/test_peagle.py,
tests/test_dflash_peers.py)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import SGLANG
from draftsmith.export import copy_export
from draftsmith.export.eagle import (
    export_eagle,
)
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.verify import verify_reference_engine


def write_eagle(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """An EAGLE-3 head in the reference layout with SGLang's layer ids."""
    return export_eagle(ckpt, out, SGLANG.name)


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
    """An export as the reference engines' (a family of its own registers its own check: ``Engine.verifiers``)."""
    return verify_reference_engine(folder, SGLANG)


SGLANG.writers.update({"eagle": write_eagle, "causal_lm": copy_export})
SGLANG.verify, SGLANG.usage = verify, usage
