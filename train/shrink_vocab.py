"""``draftsmith shrink-vocab HEAD --size N --data FILE ... --out DIR``: a faster EAGLE-3 head, same weights.

Each drafted token reads the head's whole draft LM head (draft vocabulary x hidden). For a one-layer
head that product is most of the drafting cost on a weight-bound device, yet the rarest rows are
almost never the target's choice. This keeps the N rows of the tokens most frequent in the given
conversations' assistant turns (best: the target's own answers, from `draftsmith data regenerate`) and
drops the rest (frequency-ranked draft vocabularies, as in FR-Spec). Nothing is retrained: on tokens
still in the vocabulary the head ranks exactly as before, and decoding stays lossless.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from draftsmith.drafts.eagle import EagleHead

HELP = (
    __doc__.split("\n\n", 1)[1]
    + """
Example (a head trained with a 32,000-token draft vocabulary, kept to the 8,192 most frequent tokens of
the target's own answers; what that saves is in docs/studies/gpu_h200.md):

  draftsmith shrink-vocab HEAD_DIR --size 8192 --out HEAD_DIR_v8k --data regenerated.jsonl
"""
)

EXTRA_FILES = ("train_config.yaml", "train_state.json")
RECORD = "shrink_vocab.json"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "shrink-vocab",
        help="keep only the most frequent rows of an EAGLE-3 head's draft vocabulary (faster drafting)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("head", help="an EAGLE-3 head directory saved by `draftsmith train` (RUN/draft)")
    p.add_argument("--size", required=True, type=int, metavar="N", help="draft vocabulary size to keep")
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        metavar="SOURCE",
        help="conversations whose assistant tokens are counted (files, builtin: or hf: sources, in any shape "
        "`train` reads)",
    )
    p.add_argument("--out", required=True, help="directory for the smaller head (must not exist)")
    p.add_argument(
        "--target", default=None, help="the head's target (default: the one recorded in the head's config)"
    )
    p.add_argument(
        "--max-length", type=int, default=2048, help="tokens per conversation counted (default: 2048)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from draftsmith import files
    from draftsmith.drafts.base import EAGLE3, PEAGLE, kind_of_checkpoint
    from draftsmith.drafts.eagle import EagleHead
    from draftsmith.loading import resolve_model_path, tokenizer_fingerprint
    from draftsmith.train.corpus.tokens import build_dataset, count_tokens

    head_dir, out = Path(args.head), Path(args.out)
    if not (head_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{head_dir} is not a head directory saved by `draftsmith train` (no config.json)"
        )
    kind = kind_of_checkpoint(head_dir)
    if kind.name not in (EAGLE3, PEAGLE):
        raise ValueError(
            f"{head_dir} is a {kind.title} ({kind.name}); shrink-vocab works on EAGLE-3 and P-EAGLE heads (their "
            "own draft LM head)"
        )
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new --out directory (nothing was written)")
    head = EagleHead.from_pretrained(head_dir, dtype=torch.float32)
    recorded = head.config.target
    spec = args.target or recorded["name"]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(spec)[0])
    if tokenizer_fingerprint(tokenizer) != recorded["tokenizer_fingerprint"]:
        raise ValueError(
            f"the tokenizer of {spec!r} is not the one {head_dir} was trained with (fingerprints "
            f"{tokenizer_fingerprint(tokenizer)} and {recorded['tokenizer_fingerprint']}); pass --target "
            f"with the head's own target ({recorded['name']!r})"
        )
    dataset = build_dataset(args.data, tokenizer, args.max_length, pack=False, limit=None, seed=0)
    counts = count_tokens(dataset, recorded["vocab_size"])
    before_size = head.config.draft_vocab_size
    covered_before = float(counts[head.d2t].sum()) / max(1, int(counts.sum()))
    shrink_head_vocab(head, counts, args.size)
    covered = float(counts[head.d2t].sum()) / max(1, int(counts.sum()))
    record = {
        "from": str(head_dir),
        "draft_vocab_size": [before_size, args.size],
        "data": list(args.data),
        "tokens_counted": int(counts.sum()),
        "coverage": [covered_before, covered],
    }

    def fill(tmp: Path) -> None:
        head.save_pretrained(tmp)
        for name in EXTRA_FILES:
            if (head_dir / name).is_file():
                shutil.copy(head_dir / name, tmp / name)
        (tmp / RECORD).write_text(json.dumps(record, indent=2))

    files.replace_dir(out, fill)
    print(
        f"[draftsmith] {out}: draft vocabulary {before_size:,} -> {args.size:,}; of {int(counts.sum()):,} "
        f"assistant tokens counted, {100 * covered_before:.2f}% -> {100 * covered:.2f}% are in it"
    )
    return 0


def shrink_head_vocab(head: EagleHead, token_counts: torch.Tensor, draft_vocab_size: int) -> EagleHead:
    """Keep only the ``draft_vocab_size`` most frequent tokens of the draft vocabulary (EAGLE-3).

    Drafting reads the whole draft LM head for every drafted token, and on a weight-bound device that
    product is most of a one-layer head's cost; the rarest rows are seldom the target's choice. The
    kept rows are copied unchanged, so on tokens still in the vocabulary the head ranks as before
    (``token_counts`` [V]: frequencies over target ids, e.g. of the target's own answers; ties keep
    the lower id). The config's ``draft_vocab_size`` follows. In place; returns ``head``.
    """
    import torch
    from torch import nn

    from draftsmith.drafts.base import EAGLE3

    with torch.no_grad():
        if head.config.preset != EAGLE3 or head.config.lm_head_is_embedding:
            raise ValueError(
                "shrink_vocab needs an EAGLE-3 head with its own LM head over a draft vocabulary"
            )
        current = head.config.draft_vocab_size
        if not 1 <= draft_vocab_size <= current:
            raise ValueError(
                f"draft_vocab_size must be in 1..{current} (this head's), got {draft_vocab_size}"
            )
        counts = token_counts.reshape(-1).double()
        if counts.numel() != head.config.vocab_size:
            raise ValueError(
                f"token_counts has {counts.numel()} entries, the target vocabulary {head.config.vocab_size}"
            )
        order = torch.sort(counts[head.d2t], descending=True, stable=True).indices[:draft_vocab_size]
        keep = order.sort().values  # draft ids in ascending target-id order, as build_vocab_map makes them
        old = head.lm_head
        head.lm_head = nn.Linear(old.in_features, draft_vocab_size, bias=False, device=old.weight.device)
        head.lm_head.weight.copy_(old.weight[keep].to(head.lm_head.weight.dtype))
        head.lm_head.to(old.weight.dtype)
        d2t = head.d2t[keep].clone()
        t2d = torch.zeros_like(head.t2d)
        t2d[d2t] = True
        head.d2t, head.t2d = d2t, t2d  # buffers: assigning a tensor replaces the registered buffer
        head.config.draft_vocab_size = draft_vocab_size
        return head
