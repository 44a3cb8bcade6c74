"""Divergence × data mode for distilled small drafts: which choice wins, on which category.

For one draft size (``--num-layers`` target layers, evenly spaced, first and last included) it trains
one draft per (divergence, data mode) with the same recipe and budget, then evaluates them all in one
``draftsmith eval`` run (same prompts, same process, baseline measured alongside) together with
the same draft before distillation and the untrained ``layers:N`` draft of equal depth.

Data modes: ``fixed`` (the shipped conversations), ``regenerated`` (the target's own answers,
``draftsmith data regenerate``; give the file with --regenerated), ``on_policy`` (a share of each
batch replaced by the draft's own continuations, scored by the target — DistillSpec's on-policy data).

Finished runs are skipped when the script is rerun (delete their folder to retrain). Prints a table
and writes JSON.

    python bench/distill_sweep.py --steps 32 --limit 18 --max-new-tokens 64 \\
        --regenerated runs/qs/regenerated.jsonl --out bench/results/distill_sweep.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchlib.records import write_json

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "smollm2_distill.yaml"
LOSSES = ("fkl", "rkl", "jsd", "tvd")
MODES = ("fixed", "regenerated", "on_policy")


def draftsmith(*argv: str) -> None:
    """Run one draftsmith command in a child process (its own memory, its own progress output)."""
    cmd = [sys.executable, "-m", "draftsmith.cli", *argv]
    print("\n$ draftsmith " + " ".join(argv), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def mode_overrides(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "fixed":
        return []
    if mode == "regenerated":
        if not args.regenerated:
            raise SystemExit("mode 'regenerated' needs --regenerated FILE.jsonl (draftsmith data regenerate)")
        return [f"--data.regenerated={args.regenerated}"]
    if mode == "on_policy":
        return [
            f"--draft.options.on_policy_fraction={args.on_policy_fraction}",
            f"--draft.options.on_policy_max_new_tokens={args.on_policy_tokens}",
        ]
    raise SystemExit(f"unknown data mode {mode!r}; choose from {', '.join(MODES)}")


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"--draft.options.num_layers={args.num_layers}",
        f"--trainer.max_steps={args.steps}",
        f"--trainer.batch_size={args.batch_size}",
        f"--trainer.val_every={args.steps}",
        f"--trainer.ckpt_every={args.steps}",
        "--trainer.log_every=4",
        f"--data.max_length={args.max_length}",
        "--data.heldout=16",
        f"--data.limit={args.steps * args.batch_size + 16}",  # one pass over fresh conversations
        f"--optim.lr={args.lr}",
        f"--optim.warmup_steps={max(1, args.steps // 10)}",
    ]


def finished(run_dir: Path, steps: int) -> bool:
    state = run_dir / "draft" / "train_state.json"
    return state.exists() and json.loads(state.read_text()).get("step", -1) >= steps


def save_undistilled(out: Path, num_layers: int) -> Path:
    """The draft exactly as distillation starts from it (the recipe's init), saved untrained."""
    from draftsmith.decode.target import load_target
    from draftsmith.drafts.base import DISTILL
    from draftsmith.train.config import load_config
    from draftsmith.train.registry import build_objective

    path = out / "undistilled"
    if (path / "config.json").exists():
        return path
    config = load_config(RECIPE, [f"--draft.options.num_layers={num_layers}"])
    target = load_target(config.target.spec, dtype=config.target.dtype)
    objective = build_objective(DISTILL, target, config.draft.options)
    objective.save(objective.build_draft(), path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4, help="draft depth in target layers (default 4)")
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--regenerated", help="JSONL of the target's own answers (for mode 'regenerated')")
    p.add_argument("--on-policy-fraction", type=float, default=0.5)
    p.add_argument("--on-policy-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="training steps per draft")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--limit", type=int, default=18, help="dev prompts to evaluate on (round-robin)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--runs", default="runs/distill_sweep", help="where the drafts are trained")
    p.add_argument("--out", default="bench/results/distill_sweep.json")
    args = p.parse_args()

    runs = ROOT / args.runs
    runs.mkdir(parents=True, exist_ok=True)
    trained: dict[str, Path] = {}
    train_seconds: dict[str, float] = {}
    for mode in args.modes:
        for loss in args.losses:
            name = f"{loss}/{mode}"
            run_dir = runs / f"{loss}_{mode}"
            if not finished(run_dir, args.steps):
                start = time.perf_counter()
                resume = ["--resume"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
                draftsmith(
                    "train", str(RECIPE), f"--draft.options.loss={loss}", f"--output.dir={run_dir}",
                    *common_overrides(args), *mode_overrides(mode, args), *resume,
                )  # fmt: skip
                train_seconds[name] = time.perf_counter() - start
            trained[name] = run_dir / "draft"

    from draftsmith.drafts.base import LAYERS

    undistilled = save_undistilled(runs, args.num_layers)
    eval_dir = runs / "eval"
    layers = f"{LAYERS}:{args.num_layers}"
    drafts = [str(undistilled), layers, *map(str, trained.values())]
    draftsmith(
        "eval", "--target", "smollm2-135m-instruct", *[a for d in drafts for a in ("--draft", d)],
        "--prompts", "builtin:dev_prompts", "--order", "round-robin",
        "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--k", str(args.k),
        "--out", str(eval_dir), "--overwrite",
    )  # fmt: skip

    report = json.loads((eval_dir / "report.json").read_text())
    label = {str(undistilled): "undistilled", layers: layers}
    label.update({str(path): name for name, path in trained.items()})
    rows = []
    for method in report["drafts"]:
        name = label.get(method["name"], method["name"])
        rows.append(
            {
                "draft": name,
                "tau": method["tau"],
                "alpha": method["alpha"],
                "speedup": method["speedup"],
                "exact_match": method["exact_match"],
                "tau_by_category": {c: v["tau"] for c, v in method["categories"].items()},
                "speedup_by_category": {c: v["speedup"] for c, v in method["categories"].items()},
                "train_seconds": train_seconds.get(name),
            }
        )
    categories = sorted({c for r in rows for c in r["tau_by_category"]})
    print(f"\n{'draft':<22}{'τ':>6}{'speedup':>9}  " + "".join(f"{c[:10]:>11}" for c in categories))
    for r in rows:
        speed = f"{r['speedup']:.2f}"
        cats = "".join(f"{r['tau_by_category'].get(c, float('nan')):>11.2f}" for c in categories)
        print(f"{r['draft']:<22}{r['tau']:>6.2f}{speed:>9}  {cats}")
    result = {
        "settings": vars(args),
        "hardware": report["hardware"],
        "baseline_tokens_per_s": report["baseline"]["tokens_per_s"],
        "rows": rows,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
