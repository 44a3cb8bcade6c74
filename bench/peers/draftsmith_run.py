"""draftsmith's side: ``draftsmith train quickstart`` for the bench's token budget.

Run by bench/peer_training.py with the project's python. It does what the CLI does
(``train/cli.py``: ``load_config`` of the recipe with dotted overrides, then ``train``) in this
process, so the optimizer steps can be timed and the final validation read back. The only
overrides: ``trainer.max_steps`` from the token budget (the steps whose rows the bench gave the
peers, in the same order), ``trainer.max_time=null`` (the budget, not the clock, ends the run) and
the output folder. Everything else is the quickstart recipe (online: the target runs in every step).

``--override KEY=VALUE`` (repeatable) changes the recipe for an ablation (``optim.lr=1e-4``, ...).
With another ``trainer.batch_size`` the run takes as many steps as see the same number of rows.
``--draft dflash``: the quickstart recipe with its ``draft`` section replaced by a DFlash draft (one layer,
block size 8, DFlash's defaults otherwise: ``train/peer_inputs.draftsmith_dflash_draft``), written beside
the run as ``recipe.yaml``; the rest of the recipe (data, optimizer, schedule, batch) as it is.
"""

from __future__ import annotations

import argparse
import sys

from driver import driver_args, record_steps, write_result

from draftsmith.train.config import load_config, resolve_recipe
from draftsmith.train.loop import train
from draftsmith.train.peer_inputs import draftsmith_dflash_draft


def recipe(draft: str, out) -> str:
    """The quickstart recipe, or for DFlash a copy of it with the bench's DFlash draft."""
    if draft != "dflash":
        return "quickstart"
    import yaml

    data = yaml.safe_load(resolve_recipe("quickstart").read_text())
    data["draft"] = draftsmith_dflash_draft()
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def main() -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    known, sys.argv[1:] = extra.parse_known_args()
    args, budget = driver_args()
    ablation = [f"--{item.removeprefix('--')}" for item in known.override]
    base = recipe(args.draft, args.out)
    config = load_config(base, ablation)
    rows = budget["draftsmith_steps"] * budget["batch_size"]
    steps = -(-rows // config.trainer.batch_size)
    overrides = [*ablation, f"--trainer.max_steps={steps}", "--trainer.max_time=null",
                 f"--output.dir={args.out / 'run'}"]  # fmt: skip
    config = load_config(base, overrides)
    marks = record_steps()
    result = train(config, overwrite=True)
    write_result(
        args.out, marks, result.draft_dir, heldout=result.val, steps=result.steps, overrides=overrides
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
