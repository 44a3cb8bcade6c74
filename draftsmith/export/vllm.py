"""The ``vllm`` engine's work: EAGLE-3 heads in the reference layout with vLLM's layer ids (``eagle.py``),
distilled drafts as their transformers directory (vLLM's ``draft_model`` method)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import VLLM
from draftsmith.export import copy_export
from draftsmith.export.eagle import export_eagle
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.verify import verify_reference_engine


def write_eagle(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    return export_eagle(ckpt, out, VLLM.name)


def usage(card: CardContext) -> list[str]:
    base, repo, k = card.base_model, card.repo_id, card.k
    if card.kind.family == "causal_lm":
        config, model = '"method": "draft_model"', f'"model": "{repo}"'
        export = []
    else:
        config, model = '"method": "eagle3"', '"model": "draft-vllm"'
        export = [f"draftsmith export {repo} --to vllm --out draft-vllm"]
    return [
        "### vLLM",
        "",
        "```bash",
        *export,
        f"vllm serve {base} --speculative-config '{{{config}, {model}, \"num_speculative_tokens\": {k}}}'",
        "```",
        "",
    ]


VLLM.writers.update({"eagle": write_eagle, "causal_lm": copy_export})
VLLM.verify, VLLM.usage = partial(verify_reference_engine, engine=VLLM), usage
