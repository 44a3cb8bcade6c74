"""The ``draftsmith`` command: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives (``eval/cli.py``, ``train/cli.py``, ...) and
exposes ``add_parser(subparsers)``; the module is imported only when its subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings

from draftsmith import files

# subcommand -> (module with add_parser, one-line help)
SUBCOMMANDS = {
    "eval": ("draftsmith.eval.cli", "measure τ, acceptance and speedup of drafts against the target alone"),
    "train": ("draftsmith.train.cli", "train a draft from a YAML recipe"),
    "data": (
        "draftsmith.train.corpus.cli",
        "prepare training data (e.g. regenerate responses with the target)",
    ),
    "shrink-vocab": (
        "draftsmith.train.shrink_vocab",
        "keep only the most frequent rows of an EAGLE-3 head's draft vocabulary (faster drafting)",
    ),
    "publish": (
        "draftsmith.publish.cli",
        "publish a draft checkpoint to the Hugging Face Hub with a model card of measured numbers",
    ),
    "export": (
        "draftsmith.export.cli",
        "export a draft in the layout a serving engine loads (the engines: `draftsmith export --help`)",
    ),
    "quickstart": (
        "draftsmith.quickstart",
        "train an EAGLE-3 head on the bundled target and evaluate it (minutes on a CPU)",
    ),
}


THIRD_PARTY_NOISE = (
    # (module the warning is told from, the start of its message): deprecations inside the libraries
    # draftsmith runs on, which the user can do nothing about
    (r"lightning\.", r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (r"transformers\.", r"`is_gradient_checkpointing` is deprecated"),
)
LIGHTNING_TIPS = ("lightning.pytorch.utilities.rank_zero", "💡 Tip:")
"""The logger Lightning advertises its add-ons through, and how such a line starts."""


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(LIGHTNING_TIPS[1])


def quiet_third_parties() -> None:
    """Keep off the command line's screen what says nothing to a draftsmith user: the libraries' own
    deprecation warnings (by module and message, nothing broader) and Lightning's tips. Called by ``main``
    only: a program that imports draftsmith keeps every warning; draftsmith's own are never filtered."""
    for module, message in THIRD_PARTY_NOISE:
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
    logger = logging.getLogger(LIGHTNING_TIPS[0])
    if _not_a_tip not in logger.filters:
        logger.addFilter(_not_a_tip)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train, evaluate and publish speculative-decoding drafts for Hugging Face causal LMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            sub.add_parser(name, help=f"{help_text} (not available in this build)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    quiet_third_parties()
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    args.argv = list(argv)  # what was run, for a message that says how to rerun it (a resumable job)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except (
        ValueError, FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, files.DiskFullError
    ) as err:  # fmt: skip
        print(f"draftsmith {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"draftsmith {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
