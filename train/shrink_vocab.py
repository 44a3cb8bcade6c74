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
    from transformers import AutoTokenizer

    from draftsmith import files
    from draftsmith.drafts.eagle import load_vocab_head
    from draftsmith.drafts.eagle_parts import shrink_head_vocab
    from draftsmith.loading import resolve_model_path, tokenizer_fingerprint
    from draftsmith.train.corpus.tokens import build_dataset, count_tokens

    head_dir, out = Path(args.head), Path(args.out)
    if not (head_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{head_dir} is not a head directory saved by `draftsmith train` (no config.json)"
        )
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a new --out directory (nothing was written)")
    head = load_vocab_head(head_dir)
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
