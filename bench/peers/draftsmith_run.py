"""draftsmith's side: ``draftsmith train`` of the sweep's base recipe (the quickstart's as the sweep began,
``sweep_base.yaml``) for the bench's token budget.

Run by bench/peer_training.py with the project's python. It does what the CLI does
(``train/cli.py``: ``load_config`` of the recipe with dotted overrides, then ``train``) in this
process, so the optimizer steps can be timed and the final validation read back. The only
overrides: ``trainer.max_steps`` from the token budget (the steps whose rows the bench gave the
peers, in the same order), ``trainer.max_time=null`` (the budget, not the clock, ends the run) and
the output folder. Everything else is the quickstart recipe (online: the target runs in every step).
An online run that finds a checkpoint of its own in its folder (a run stopped part way: a session's end,
a scheduler's SIGTERM) resumes from it, exactly (``train(resume=True)``); its step marks then cover the
steps after the resume only. ``--fresh`` (the bench asks for a finished run to train again) starts from step 0.

``--override KEY=VALUE`` (repeatable) changes the recipe for an ablation (``optim.lr=1e-4``, ...).
With another ``trainer.batch_size`` the run takes as many steps as see the same number of rows; with
``data.pack=false`` one conversation a row, as many as the peers get, each pipeline's unit of a step
(``online_steps``). Those are the first conversations of draftsmith's own shuffle, a sample of the same
pool as the peers' (the ones packed into the rows above), not the very same conversations.
``--draft dflash``: the quickstart recipe with its ``draft`` section replaced by a DFlash draft (one layer,
block size 8, DFlash's defaults otherwise: ``bench/benchlib/peer_inputs.draftsmith_dflash_draft``), written beside
the run as ``recipe.yaml``; the rest of the recipe (data, optimizer, schedule, batch) as it is.

``--offline DIR`` (bench/step_like_for_like.py): the quickstart recipe offline from the feature cache in
``DIR/{train,heldout}`` that bench wrote from the peers' capture (``cache.teacher: final_state``: the
target's final norm and LM head in every step), one pass over its rows (whole batches), validated once at
the end. ``train`` would check the cache's rows against the recipe's own dataset and capture its own, so
the run is put together from the loop's parts instead (``make_loaders``, ``DraftModule``,
``make_trainer``: the same training step); the target is the skeleton an offline run with a complete
cache loads (embedding, final norm, LM head), from the folder the capture ran (``target_path``).
Every batch's real tokens and positions are counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from driver import driver_args, record_steps, write_result

from draftsmith.train.config import load_config
from draftsmith.train.infra.checkpoint import resume_point
from draftsmith.train.loop import train
from draftsmith.train.objective import Batch

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/, for benchlib
from benchlib.peer_inputs import draftsmith_dflash_draft  # noqa: E402

SWEEP_BASE = Path(__file__).with_name("sweep_base.yaml")
"""The quickstart recipe as the sweep began, frozen (its header says why)."""


def recipe(draft: str, out) -> str:
    """The sweep's base recipe (``SWEEP_BASE``), or for DFlash a copy of it with the bench's DFlash draft."""
    if draft != "dflash":
        return str(SWEEP_BASE)
    import yaml

    data = yaml.safe_load(SWEEP_BASE.read_text())
    data["draft"] = draftsmith_dflash_draft()
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


class StepTokens(L.Callback):
    """Real tokens and positions (padding included) of every training batch, in order."""

    def __init__(self):
        self.tokens: list[int] = []
        self.positions: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        mask = (batch if isinstance(batch, Batch) else batch[0]).attention_mask
        self.tokens.append(int(mask.sum()))
        self.positions.append(mask.numel())


def train_from_cache(config, cache: Path, work: Path, callbacks: list) -> tuple[int, dict]:
    """(steps, last validation) of ``config`` trained offline on the bench's cache (module docstring)."""
    from draftsmith.decode.target import load_target_skeleton
    from draftsmith.train.corpus.tokens import pad_id_of
    from draftsmith.train.infra.distributed import resolve_auto_precision
    from draftsmith.train.loop import make_loaders, make_trainer
    from draftsmith.train.module import DraftModule
    from draftsmith.train.registry import build_objective

    config = resolve_auto_precision(config)
    tc, out = config.target, Path(config.output.dir)
    target = load_target_skeleton(tc.spec, "cpu", tc.dtype, tc.chat_template)
    counts = json.loads((work / "data" / "vocab_counts.json").read_text())["assistant"]
    token_counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for token, n in counts.items():
        token_counts[int(token)] = n
    L.seed_everything(config.trainer.seed, workers=True, verbose=False)
    objective = build_objective(config.draft.kind, target, config.draft.options, token_counts)
    loaders = make_loaders(config, None, None, pad_id_of(target.tokenizer), (cache / "train", cache / "heldout"),
                           target.dtype)  # fmt: skip
    module = DraftModule(objective, config, target, out)
    trainer = make_trainer(config, out, callbacks=callbacks, enable_progress_bar=False)
    trainer.fit(module, *loaders)
    val = {k: v for k, v in module.val_history[-1].items() if k not in ("step", "histogram")}
    return trainer.global_step, {**val, "precision": config.trainer.precision, "target_dtype": tc.dtype}


def train_or_resume(config, run: Path, callbacks: list, fresh: bool = False):
    """(``train``'s result, the checkpoint it resumed from or None): a run stopped part way (a session's end,
    a scheduler's SIGTERM) goes on from the last checkpoint in its folder ``run``; otherwise, or ``fresh``, it
    starts from step 0, replacing what the folder holds."""
    resumed_from = None if fresh else resume_point(run)
    if resumed_from is not None:
        print(f"draftsmith_run: resuming from {resumed_from}", flush=True)
    result = train(
        config, resume=resumed_from is not None, overwrite=resumed_from is None, callbacks=callbacks
    )
    return result, resumed_from


def online_steps(pack: bool, batch_size: int, budget: dict) -> int:
    """Optimizer steps of an online run at the bench's budget: packed rows, as many as the bench gave the peers
    the conversations of (its ``draftsmith_steps`` at its ``batch_size``), at this run's batch size; unpacked
    (``data.pack=false``), one conversation a row, as many conversations as the peers train on."""
    rows = budget["draftsmith_steps"] * budget["batch_size"] if pack else budget["train"]["conversations"]
    return -(-rows // batch_size)


def main() -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    extra.add_argument("--fresh", action="store_true", help="train from step 0, never resume")
    known, sys.argv[1:] = extra.parse_known_args()
    args, budget = driver_args()
    ablation = [f"--{item.removeprefix('--')}" for item in known.override]
    base = recipe(args.draft, args.out)
    config = load_config(base, ablation)
    counter = StepTokens()
    marks = record_steps()
    resumed_from = None
    if args.offline:
        from draftsmith.train.feature_dataset import FeatureCache

        steps = len(FeatureCache(args.offline / "train")) // config.trainer.batch_size  # whole batches
        # the target folder the capture ran (its final norm and LM head), not the recipe's own conversion of it
        overrides = [*ablation, f"--target.spec={budget['target_path']}", "--mode=offline",
                     "--cache.teacher=final_state", f"--cache.dir={args.offline}",
                     f"--trainer.max_steps={steps}", "--trainer.max_time=null", f"--trainer.val_every={steps}",
                     f"--trainer.ckpt_every={steps}", f"--output.dir={args.out / 'run'}"]  # fmt: skip
        config = load_config(base, overrides)
        taken, heldout = train_from_cache(config, args.offline, args.work, [counter])
        head = args.out / "run" / "draft"
    else:
        steps = online_steps(config.data.pack, config.trainer.batch_size, budget)
        overrides = [*ablation, f"--trainer.max_steps={steps}", "--trainer.max_time=null",
                     f"--output.dir={args.out / 'run'}"]  # fmt: skip
        config = load_config(base, overrides)
        result, resumed_from = train_or_resume(config, args.out / "run", [counter], known.fresh)
        taken, heldout, head = result.steps, result.val, result.draft_dir
    write_result(args.out, marks, head, heldout=heldout, steps=taken, overrides=overrides, resumed_from=resumed_from,
                 step_tokens=counter.tokens[: len(marks)], step_positions=counter.positions[: len(marks)])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
