"""``draftsmith quickstart``: the whole pipeline once, on the bundled target, in about 10 minutes on a CPU.

1. prompts: the first user turn of conversations from the training files, taken from each file in
   turn (ShareGPT chat, GSM8K math, GPTeacher code) — never from the dev prompts;
2. ``draftsmith data regenerate``: the target answers them (self-distillation data);
3. ``draftsmith train configs/quickstart.yaml``: an EAGLE-3 head on those answers;
4. ``draftsmith eval``: the head against the n-gram drafter and the target alone on dev prompts.

Every step is resumable: rerun the command after an interruption and finished steps are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
from itertools import zip_longest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
TRAIN_FILES = ["sharegpt_1000.jsonl", "gsm8k_train.jsonl", "gpteacher_codegen.json"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quickstart",
        help="regenerate data, train an EAGLE-3 head and evaluate it on the bundled target (~10 min, CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="runs/quickstart", help="working directory (default: %(default)s)")
    p.add_argument("--data", default=str(DATA), help="the shared data folder (train/ and dev/ inside)")
    p.add_argument(
        "--prompts", type=int, default=480, help="training prompts to regenerate (default: %(default)s)"
    )
    p.add_argument("--max-new-tokens", type=int, default=192, help="tokens per regenerated answer")
    p.add_argument("--eval-prompts", type=int, default=24, help="dev prompts to evaluate on")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="--section.key=value overrides for training")
    p.set_defaults(func=run)
    return p


def first_user_turns(data: Path, count: int) -> list[dict]:
    """``count`` single-turn conversations, taken from each training file in turn."""
    from draftsmith.train.data import iter_conversations

    def firsts(path: Path):
        for index, messages in iter_conversations(path):
            user = next((m for m in messages if m["role"] == "user"), None)
            if user and 0 < len(user["content"]) <= 2000:
                yield {"id": f"{path.name}:{index}", "messages": [user]}

    streams = [firsts(data / "train" / name) for name in TRAIN_FILES]
    chosen: list[dict] = []
    for group in zip_longest(*streams):
        chosen.extend(r for r in group if r is not None)
        if len(chosen) >= count:
            break
    return chosen[:count]


def run(args: argparse.Namespace) -> int:
    from draftsmith.cli import main

    data = Path(args.data)
    if not (data / "train").is_dir() or not (data / "dev" / "prompts.jsonl").is_file():
        raise FileNotFoundError(
            f"{data} has no train/ and dev/prompts.jsonl; pass --data to the shared data folder"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts, regenerated = out / "prompts.jsonl", out / "regenerated.jsonl"
    if not prompts.exists():
        tmp = prompts.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in first_user_turns(data, args.prompts)))
        os.replace(tmp, prompts)

    def step(title: str, argv: list[str]) -> None:
        print(f"\n[quickstart] {title}\n  draftsmith {' '.join(argv)}", flush=True)
        code = main(argv)
        if code:
            raise SystemExit(code)

    target = ["--target", "smollm2-135m-instruct", "--device", args.device]
    step(
        "1/3 the target answers the training prompts (self-distillation data)",
        ["data", "regenerate", *target, "--data", str(prompts), "--out", str(regenerated),
         "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "16"],
    )  # fmt: skip
    run_dir = out / "eagle3"
    resume = ["--resume"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
    if not (run_dir / "draft" / "config.json").exists() or resume:
        step(
            "2/3 train an EAGLE-3 head on the target's own answers",
            ["train", str(ROOT / "configs" / "quickstart.yaml"), f"--data.regenerated={regenerated}",
             f"--output.dir={run_dir}", f"--target.device={args.device}", *resume, *args.overrides],
        )  # fmt: skip
    step(
        "3/3 evaluate on held-out dev prompts: the head and n-gram lookup vs the target alone",
        ["eval", *target, "--draft", str(run_dir / "draft"), "--draft", "ngram",
         "--prompts", str(data / "dev" / "prompts.jsonl"), "--order", "round-robin",
         "--limit", str(args.eval_prompts), "--max-new-tokens", "128", "--out", str(out / "eval")],
    )  # fmt: skip
    print(
        f"\n[quickstart] done.\n  draft checkpoint: {run_dir / 'draft'}\n"
        f"  eval report:      {out / 'eval' / 'report.md'}\n"
        f"  training logs:    {run_dir / 'logs'} (CSV), {run_dir / 'tensorboard'} (TensorBoard)",
        flush=True,
    )
    return 0
