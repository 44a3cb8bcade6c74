"""``draftsmith train CONFIG.yaml [--preset NAME ...] [--section.key=value ...] [--resume]``.

The help text lists every section and key of the typed config, generated from the dataclass
docstrings in ``train/schema.py``; torch and Lightning are imported only when training starts.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from draftsmith.train.config import load_config
from draftsmith.train.registry import objective_kinds
from draftsmith.train.schema import describe, describe_options

EXAMPLE = """examples:
  draftsmith train configs/debug_eagle3.yaml
  draftsmith train configs/quickstart.yaml --trainer.max_steps=2000 --output.dir=runs/qs
  draftsmith train configs/quickstart.yaml --output.dir=runs/qs --resume
  draftsmith train configs/smollm2_eagle3.yaml --mode=offline --draft.options.ttt_steps=5
  draftsmith train configs/smollm2_eagle3.yaml --preset ddp          (all GPUs of this node)
  torchrun --nproc-per-node 8 -m draftsmith.cli train configs/smollm2_eagle3.yaml --preset fsdp
  srun draftsmith train configs/smollm2_eagle3.yaml --preset ddp --preset multinode_slurm
strategies, presets, launchers and the exact-resume guarantees: docs/TRAINING.md
"""


class LazyEpilog(argparse.RawDescriptionHelpFormatter):
    """An epilog given as a function is written when help is printed: the kinds' options import their
    objectives (torch), which no other command line should wait for."""

    def add_text(self, text):
        super().add_text(text() if callable(text) else text)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a draft from a YAML recipe",
        description=(
            "Train a draft for a frozen target with the one training loop. The recipe is a YAML file "
            "of the sections below; any key can be overridden as --section.key=value (values are read "
            "as YAML: 5, 1e-4, true, [a.jsonl, b.jsonl])."
        ),
        epilog=lambda: (
            f"{EXAMPLE}\ndraft kinds: {', '.join(objective_kinds())}\n\nconfig keys:\n{describe()}\n"
            f"{describe_options()}"
        ),
        formatter_class=LazyEpilog,
    )
    parser.add_argument("config", help="YAML recipe (see configs/)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from <output.dir>/checkpoints/last.ckpt"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a trained draft already in <output.dir>/draft (without it, such a run is refused)",
    )
    parser.add_argument(
        "--force-resume",
        action="store_true",
        help="--resume although the recipe changed in a key other than "
        "trainer.max_steps/max_time/log_every/ckpt_every (exact resume is then not promised; the change is "
        "recorded in <output.dir>/recipe_history.jsonl)",
    )
    parser.add_argument(
        "--preset",
        action="append",
        default=[],
        help="merge a preset over the recipe (a name in configs/presets/: ddp, fsdp, deepspeed_zero2, "
        "deepspeed_zero3, multinode_slurm; or a YAML path); repeatable, overrides still win",
    )
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value overrides")
    parser.set_defaults(func=run)
    return parser


FLAGS = ("--resume", "--overwrite", "--force-resume")


def split_flags(args: list[str]) -> tuple[list[str], set[str], list[str]]:
    """(overrides, flags set, presets) from the arguments after the recipe, where argparse leaves them."""
    overrides, flags, presets = [], set(), []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in FLAGS:
            flags.add(arg)
        elif arg == "--preset":
            if i + 1 >= len(args):
                raise ValueError("--preset needs a value: a name in configs/presets/ or a YAML file")
            presets.append(args[i + 1])
            i += 1
        elif arg.startswith("--preset="):
            presets.append(arg.partition("=")[2])
        else:
            overrides.append(arg)
        i += 1
    return overrides, flags, presets


def run(args: argparse.Namespace) -> int:
    overrides, flags, presets = split_flags(args.overrides)
    config = load_config(args.config, overrides, presets=[*args.preset, *presets])

    from draftsmith.train.loop import train

    force_resume = args.force_resume or "--force-resume" in flags
    overwrite = args.overwrite or "--overwrite" in flags
    again = ["draftsmith", "train", args.config, *(f"--preset={p}" for p in [*args.preset, *presets])]
    again += overrides
    try:
        train(
            config,
            resume=args.resume or "--resume" in flags,
            overwrite=overwrite,
            force_resume=force_resume,
            resume_command=shlex.join([*again, "--resume", *(["--force-resume"] if force_resume else [])]),
            rerun_command=shlex.join([*again, *(["--overwrite"] if overwrite else [])]),
        )
    except ImportError as err:  # an optional extra the config needs (DeepSpeed) is not installed
        print(f"draftsmith train: error: {err}", file=sys.stderr)
        return 2
    return 0
