"""The ``vllm`` engine's work: EAGLE-3 heads in the reference layout with vLLM's layer ids (``eagle.py``),
distilled drafts as their transformers directory (vLLM's ``draft_model`` method). A kind with a layout of
its own registers it here from its export module (``drafts/base.KINDS``)."""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import VLLM
from draftsmith.export import copy_export
from draftsmith.export.eagle import export_eagle
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.verify import verify_reference_engine


def write_eagle(ckpt: DraftCheckpoint, out: Path, options: ExportOptions, fields=None) -> Path:
    """The reference EAGLE-3 folder, with the config ``fields`` a family that extends it adds (``export_eagle``)."""
    return export_eagle(ckpt, out, VLLM.name, fields)


def serve_section(card: CardContext, method: str, k: int, exported: bool = True) -> list[str]:
    """The card's vLLM section: the export (``exported``; else vLLM loads the repo itself) and ``vllm serve``
    with ``method`` (the speculative config's fields before the model) drafting ``k`` tokens a step."""
    model = "draft-vllm" if exported else card.repo_id
    config = f'{method}, "model": "{model}", "num_speculative_tokens": {k}'
    export = [f"draftsmith export {card.repo_id} --to vllm --out draft-vllm"] if exported else []
    return [
        "### vLLM",
        "",
        "```bash",
        *export,
        f"vllm serve {card.base_model} --speculative-config '{{{config}}}'",
        "```",
        "",
    ]


def usage(card: CardContext) -> list[str]:
    if card.kind.family.name == "causal_lm":
        return serve_section(card, '"method": "draft_model"', card.k, exported=False)
    return serve_section(card, '"method": "eagle3"', card.k)


def verify(folder: Path) -> tuple[str, list[str]]:
    """An export as the reference engines' (a family of its own registers its own check: ``Engine.verifiers``)."""
    return verify_reference_engine(folder, VLLM)


VLLM.writers.update(
    {
        "eagle": write_eagle,
        "causal_lm": copy_export,
    }  # fmt: skip
)
VLLM.verify, VLLM.usage = verify, usage
