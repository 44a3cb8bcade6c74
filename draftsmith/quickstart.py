"""``draftsmith quickstart``: the whole pipeline once, on the bundled target, in minutes on a CPU.

1. ``draftsmith train configs/quickstart.yaml``: an EAGLE-3 head on the shipped training
   conversations (ShareGPT chat, GSM8K math, GPTeacher code), the target running online, in bf16
   where the machine has fast bf16 (``precision: auto``; float32 elsewhere), ``trainer.max_time`` capping it at
   10 minutes;
   with ``--regenerate N`` it first has the target answer N training prompts (self-distillation,
   ``draftsmith data regenerate``) and trains on those answers instead — better data in principle,
   but slow to make on a CPU, and at quickstart scale it moved τ within noise (docs/studies/bf16_amx.md);
2. ``draftsmith eval``: the head against the n-gram drafter and the target alone on dev prompts
   (never trained on).

The data ships with draftsmith (``draftsmith data list``); --data trains on your own files or a Hub
dataset instead. --smoke runs the same path in a minute or two (a few steps, two prompts): a check that the
installation works, not a head. Every step is resumable: rerun the command after an interruption and
finished steps are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from draftsmith.drafts.base import EAGLE3, NGRAM
from draftsmith.sources import BUILTIN_TRAIN

PROMPTS = "builtin:dev_prompts"
SMOKE_TRAINING = [
    "--trainer.max_steps=3", "--trainer.batch_size=2", "--trainer.val_every=3", "--trainer.ckpt_every=3",
    "--trainer.log_every=1", "--trainer.max_time=null", "--data.max_length=128", "--data.limit=48",
    "--data.heldout=4",
]  # fmt: skip
"""--smoke: the quickstart recipe cut to a few steps on short rows (train's own overrides)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quickstart",
        help="train an EAGLE-3 head on the bundled target and evaluate it (minutes on a CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default=None,
        help="working directory (default: runs/quickstart, runs/quickstart_smoke with --smoke)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        default=list(BUILTIN_TRAIN),
        metavar="SOURCE",
        help="training conversations: files, builtin: names or hf: datasets (default: the shipped ones, "
        + " ".join(BUILTIN_TRAIN)
        + ")",
    )
    p.add_argument(
        "--prompts",
        default=PROMPTS,
        help="dev prompts to evaluate on (default: %(default)s, never trained on)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the same path in a minute or two: 3 training steps on short rows, 2 prompts of 16 tokens (a "
        "check of the installation, not a head)",
    )
    p.add_argument(
        "--regenerate",
        type=int,
        default=0,
        metavar="N",
        help="first have the target answer N training prompts and train on its answers (default: off)",
    )
    p.add_argument("--max-new-tokens", type=int, default=192, help="tokens per regenerated answer")
    p.add_argument(
        "--eval-prompts", type=int, default=12, help="dev prompts to evaluate on (default: %(default)s)"
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value overrides for training")
    p.set_defaults(func=run)
    return p


def training_finished(run_dir: Path, recipe: Path, overrides: list[str]) -> bool:
    """True when the exported draft already holds the recipe's last step (a rerun skips training)."""
    from draftsmith.train.config import load_config

    state = run_dir / "draft" / "train_state.json"
    if not state.exists():
        return False
    max_steps = load_config(recipe, [o for o in overrides if o.startswith("--trainer.")]).trainer.max_steps
    return json.loads(state.read_text()).get("step", -1) >= max_steps


def run(args: argparse.Namespace) -> int:
    from draftsmith.cli import main
    from draftsmith.sources import check_source
    from draftsmith.train.config import resolve_recipe
    from draftsmith.train.corpus.prompts import first_user_turns

    for spec in args.data:
        check_source(spec, "--data")
    check_source(args.prompts, "--prompts")
    out = Path(args.out or ("runs/quickstart_smoke" if args.smoke else "runs/quickstart"))
    out.mkdir(parents=True, exist_ok=True)

    def step(title: str, argv: list[str]) -> None:
        print(f"\n[quickstart] {title}\n  draftsmith {' '.join(argv)}", flush=True)
        code = main(argv)
        if code:
            raise SystemExit(code)

    target = ["--target", "smollm2-135m-instruct", "--device", args.device]
    data_override = [f"--data.paths={json.dumps(args.data)}"]
    if args.regenerate:
        prompts, regenerated = out / "prompts.jsonl", out / "regenerated.jsonl"
        if not prompts.exists():
            tmp = prompts.with_suffix(".tmp")
            rows = first_user_turns(args.data, args.regenerate)
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, prompts)
        step(
            "0/2 the target answers training prompts (self-distillation data)",
            ["data", "regenerate", *target, "--data", str(prompts), "--out", str(regenerated),
             "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "16"],
        )  # fmt: skip
        data_override.append(f"--data.regenerated={regenerated}")
    run_dir = out / EAGLE3
    recipe = resolve_recipe("quickstart")
    overrides = [*(SMOKE_TRAINING if args.smoke else []), *args.overrides]
    if not training_finished(run_dir, recipe, overrides):
        resume = ["--resume"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
        step(
            "1/2 train an EAGLE-3 head (configs/quickstart.yaml)",
            ["train", str(recipe), *data_override, f"--output.dir={run_dir}",
             f"--target.device={args.device}", *resume, *overrides],
        )  # fmt: skip
    eval_size = ["--limit", "2", "--max-new-tokens", "16"] if args.smoke else [
        "--limit", str(args.eval_prompts), "--max-new-tokens", "96"
    ]  # fmt: skip
    eval_dir = run_dir / "eval"  # inside the run: `draftsmith publish RUN` finds the report there
    step(
        "2/2 evaluate on held-out dev prompts: the head and n-gram lookup vs the target alone",
        ["eval", *target, "--draft", str(run_dir / "draft"), "--draft", NGRAM,
         "--prompts", args.prompts, "--order", "round-robin", *eval_size, "--out", str(eval_dir),
         "--overwrite"],
    )  # fmt: skip
    print(
        f"\n[quickstart] done.\n  draft checkpoint: {run_dir / 'draft'}\n"
        f"  eval report:      {eval_dir / 'report.md'}\n"
        f"  training logs:    {run_dir / 'logs'} (CSV), {run_dir / 'tensorboard'} (TensorBoard)\n"
        f"  next:             draftsmith publish {run_dir} --repo-id ORG/NAME --dry-run\n"
        f"                    draftsmith export {run_dir} --to vllm   (vLLM carries the recipe's EAGLE-3.1 norms;\n"
        f"                    llama.cpp all but norm_output: train with --draft.options.norm_output=false for --to gguf)",
        flush=True,
    )
    return 0
