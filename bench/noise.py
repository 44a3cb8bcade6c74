"""Run-to-run noise, measured: one ``draftsmith eval`` command repeated on the same machine, the same day.

Each repeat is a fresh process running the same command (the target alone and each draft interleaved prompt
by prompt, after an untimed warm-up, as every judged table here is made); nothing else runs meanwhile (the
bench lock, ``/tmp/draftsmith-bench.lock``, is held for each). For the target alone and each draft it gives
tok/s, τ and speedup per repeat, their mean, standard deviation and range as a share of the mean. τ is
deterministic (greedy), so its spread must be 0; the rates carry the machine's noise, and a speedup's
spread is what one interleaved run's speedup can be trusted to.

    python bench/noise.py --repeats 3 --draft runs/sweep_400k/runs/draftsmith/run/draft --draft ngram \\
        --out bench/results/noise.json
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib.records import provenance, write_json

LOCK = Path("/tmp/draftsmith-bench.lock")


def eval_command(drafts: list[str], limit: int, max_new_tokens: int, k: str, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "draftsmith.cli", "eval", "--target", "smollm2-135m-instruct", "--prompts",
           "builtin:dev_prompts", "--order", "round-robin", "--limit", str(limit), "--max-new-tokens",
           str(max_new_tokens), "--k", k, "--out", str(out), "--overwrite"]  # fmt: skip
    for draft in drafts:
        cmd += ["--draft", draft]
    return cmd


def figures(report: dict) -> dict[str, dict[str, float]]:
    """name → tok/s (and τ, speedup for a draft) from one eval report."""
    rows = {"target alone": {"tokens_per_s": report["baseline"]["tokens_per_s"]}}
    for draft in report["drafts"]:
        rows[draft["name"]] = {"tokens_per_s": draft["tokens_per_s"], "tau": draft["tau"],
                               "speedup": draft["speedup"]}  # fmt: skip
    return rows


def spread(values: list[float]) -> dict:
    mean = statistics.fmean(values)
    return {"values": values, "mean": mean, "sd": statistics.stdev(values) if len(values) > 1 else None,
            "range_pct": 100 * (max(values) - min(values)) / mean if mean else None}  # fmt: skip


def summarise(repeats: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, dict]]:
    """name → figure → its spread over the repeats."""
    out: dict[str, dict[str, dict]] = {}
    for name in repeats[0]:
        for key in repeats[0][name]:
            out.setdefault(name, {})[key] = spread([r[name][key] for r in repeats])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--draft", action="append", default=[], help="a draft, as `draftsmith eval --draft` takes it"
    )
    p.add_argument("--limit", type=int, default=12, help="dev prompts (round-robin over the categories)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", default="5")
    p.add_argument("--out", type=Path, default=Path("bench/results/noise.json"))
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error(f"--repeats {args.repeats}: a spread needs at least 2")
    if not args.draft:
        p.error("give at least one --draft (e.g. ngram)")
    repeats, walls = [], []
    with tempfile.TemporaryDirectory(prefix="noise-") as tmp:
        cmd = eval_command(args.draft, args.limit, args.max_new_tokens, args.k, Path(tmp) / "eval")
        for i in range(args.repeats):
            with open(LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                start = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True)
                walls.append(time.perf_counter() - start)
            if done.returncode:
                raise SystemExit(
                    f"repeat {i + 1}: draftsmith eval exited {done.returncode}:\n{done.stderr[-2000:]}"
                )
            repeats.append(figures(json.loads((Path(tmp) / "eval" / "report.json").read_text())))
            print(f"repeat {i + 1}/{args.repeats}: {walls[-1]:.0f} s", file=sys.stderr, flush=True)
    summary = summarise(repeats)
    print(f"\n{args.repeats} repeats of: draftsmith eval ... --limit {args.limit} --max-new-tokens "
          f"{args.max_new_tokens} --k {args.k} {' '.join('--draft ' + d for d in args.draft)}")  # fmt: skip
    print(f"{'setting':<40} {'figure':<13} {'mean':>8} {'sd':>8} {'range %':>8}  values")
    for name, row in summary.items():
        for key, s in row.items():
            sd = "-" if s["sd"] is None else f"{s['sd']:.3f}"
            values = " ".join(f"{v:.3f}" for v in s["values"])
            print(f"{name[-40:]:<40} {key:<13} {s['mean']:>8.3f} {sd:>8} {s['range_pct']:>8.1f}  {values}")
    write_json(args.out, {"command": cmd[1:-3], "repeats": repeats, "wall_s": walls, "summary": summary,
                          "provenance": provenance(seed=None)})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
