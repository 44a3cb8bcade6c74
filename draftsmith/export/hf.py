"""The ``hf`` engine's work: draftsmith's own transformers layout, the draft directory as it is.

Every kind with a checkpoint goes there, whatever its family (``Engine.fallback``; a family may bring its
own ``hf_writer``); a distilled draft loads as transformers' ``assistant_model``, an EAGLE head or Medusa
heads as a ``PreTrainedModel`` that draftsmith's decoder runs. The check and the card's transformers lines
are the family's (``Family.verify_hf``, ``Family.hf_usage``).
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import HF
from draftsmith.export import copy_export
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.verify import verify_hf


def write(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """The family's own hf writer, else the draft directory as it is."""
    return (ckpt.kind.family.hf_writer or copy_export)(ckpt, out, options)


def usage(card: CardContext) -> list[str]:
    """The family's transformers lines (assisted generation for a causal LM), else draftsmith's decoder."""
    base, repo = card.base_model, card.repo_id
    if card.kind.family.hf_usage is not None:
        return card.kind.family.hf_usage(base, repo)
    return [
        "### transformers",
        "",
        f"transformers has no assistant of this kind; the {card.kind.title} is a `PreTrainedModel` that draftsmith's "
        "decoder runs:",
        "",
        "```python",
        "from draftsmith.decode.speculative import generate",
        "from draftsmith.decode.target import load_target",
        "from draftsmith.drafts import build_drafter",
        "from draftsmith.eval.prompts import render",
        "",
        f'target = load_target("{base}")',
        f'drafter = build_drafter("{repo}", target)',
        'prompt = render(target.tokenizer, [{"role": "user", "content": "Hi!"}])',
        f"out = generate(target, prompt, drafter, k={card.k}, max_new_tokens=128)  # greedy: the target's own tokens",
        "print(target.tokenizer.decode(out.tokens))",
        "```",
        "",
    ]


HF.fallback, HF.verify, HF.usage = write, verify_hf, usage
