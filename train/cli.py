"""``draftsmith train CONFIG.yaml [--section.key=value ...] [--resume]``.

The help text lists every section and key of the typed config, generated from the dataclass
docstrings in ``train/config.py``; torch and Lightning are imported only when training starts.
"""

from __future__ import annotations

import argparse

from draftsmith.train.config import describe, load_config, objective_kinds

EXAMPLE = """examples:
  draftsmith train configs/debug_eagle3.yaml
  draftsmith train configs/quickstart.yaml --trainer.max_steps=2000 --output.dir=runs/qs
  draftsmith train configs/quickstart.yaml --output.dir=runs/qs --resume
  draftsmith train configs/smollm2_eagle3.yaml --mode=offline --draft.options.ttt_steps=5
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a draft from a YAML recipe",
        description=(
            "Train a draft for a frozen target with the one training loop. The recipe is a YAML file "
            "of the sections below; any key can be overridden as --section.key=value (values are read "
            "as YAML: 5, 1e-4, true, [a.jsonl, b.jsonl])."
        ),
        epilog=f"{EXAMPLE}\ndraft kinds: {', '.join(objective_kinds())}\n\nconfig keys:\n{describe()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="YAML recipe (see configs/)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from <output.dir>/checkpoints/last.ckpt"
    )
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value overrides")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    overrides = [a for a in args.overrides if a != "--resume"]
    resume = args.resume or len(overrides) != len(args.overrides)
    config = load_config(args.config, overrides)

    from draftsmith.train.loop import train

    train(config, resume=resume)
    return 0
