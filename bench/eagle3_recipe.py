"""The EAGLE-3 recipe issue's tables: draftsmith's ablations at 0.4M tokens beside every peer's chosen point.

Reads the ablation record written by ``bench/peer_training.py`` (runs ``draftsmith-r45*``: draftsmith's Muon point,
one packed 512-token row a step, with one change each, then the keeper at more seeds; each judged by
``bench/heldout_tau.py`` on the quickstart's held-out rows right after it trained) and the peers' 3-seed records
of the 0.4M sweep (``peer_seeds_400k.json``; the same data stage, capture and held-out judge, so their held-out
figures are reused, not retrained). Prints the ablation table and the deciding table, writes JSON with a
``summary`` list of ``{"pipeline", "setting", "tokens", "dev_tau", "heldout_tau"}`` (the default marked
``"default": true``). dev τ is listed only where it was judged in one interleaved run with the others; a peer's
dev figures from the earlier sweep runs (12 prompts, another run) are not mixed in.

    python bench/eagle3_recipe.py --record bench/results/eagle3_recipe_400k.json \\
        --peers bench/results/peer_seeds_400k.json bench/results/peer_seeds_400k_muon.json --out bench/results/eagle3_recipe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from draftsmith.eval.report import provenance, write_json

BASE = "draftsmith-r45base"
KEEPER = "draftsmith-r45norms"
DEFAULT_SETTING = ["trainer.batch_size=1", "optim.name=muon", "draft.options.norm_before_fc=true",
                   "draft.options.norm_output=true", "draft.options.norm_before_residual=true"]  # fmt: skip
CHANGES = {
    "r45base": "none: draftsmith's Muon point (trainer.batch_size=1, optim.name=muon), this machine",
    "r45norms": "EAGLE-3.1 norms: norm_before_fc + norm_output + norm_before_residual",
    "r45fcres": "llama.cpp's two of them: norm_before_fc + norm_before_residual (no norm_output)",
    "r45out": "norm_output alone",
    "r45dpace": "step_weighting dpace (D-PACE, alpha 0.5)",
    "r45walk": "step_weighting walk (ours: D-PACE on the draft's greedy hits)",
    "r45lk": "loss lk_hybrid (LK^lambda, eta 3)",
    "r45opt": "speculators' optimizer split: AdamW lr 1e-4 wd 0.01 on the rest, Muon lr 1e-3, clip 1.0",
    "r45lin": "speculators' schedule: linear decay to 0, warm-up 1 % (8 steps)",
    "r45noise": "uniform feature noise +-0.05 on the tapped states",
}


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) if values else None,
            "sd": statistics.stdev(values) if len(values) > 1 else None, "n": len(values), "values": values}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", type=Path, default=Path("bench/results/eagle3_recipe_400k.json"))
    p.add_argument(
        "--peers",
        type=Path,
        nargs="+",
        help="3-seed records of the sweep (every pipeline's point)",
        default=[Path("bench/results/peer_seeds_400k.json"), Path("bench/results/peer_seeds_400k_muon.json")],
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/eagle3_recipe.json"))
    args = p.parse_args(argv)
    record = json.loads(args.record.read_text())
    tokens = record["budget"]["tokens_asked"]
    runs = {name: run for name, run in record["train"].items() if (run.get("judge") or {}).get("tau")}
    base = runs[BASE]["judge"]["tau"]

    ablations = []
    print(
        f"Ablations at {tokens:,} tokens, one seed each (held-out judge, k 5); Δ against {BASE} ({base:.3f})"
    )
    for name, run in runs.items():
        label = name.removeprefix("draftsmith-")
        if "-seed" in label:
            continue
        tau = run["judge"]["tau"]
        row = {"run": name, "change": CHANGES.get(label, "; ".join(run.get("overrides", []))), "heldout_tau": tau,
               "delta": tau - base, "per_position": run["judge"].get("per_position"),
               "commit": run["provenance"]["commit"], "machine": run["provenance"]["machine"]["cpu"],
               "date": run["provenance"]["date"], "wall_s": run.get("wall_s")}  # fmt: skip
        ablations.append(row)
        print(f"  {label:10s} {tau:6.3f} {tau - base:+6.3f}  {row['change']}")

    keeper = [runs[n]["judge"]["tau"] for n in (KEEPER, f"{KEEPER}-seed1", f"{KEEPER}-seed2") if n in runs]
    summary = [{"pipeline": "draftsmith", "setting": DEFAULT_SETTING, "tokens": tokens, "dev_tau": [],
                "heldout_tau": keeper, "default": True, "runs": [n for n in runs if n.startswith(KEEPER)]}]  # fmt: skip
    seen = set()
    for (
        path
    ) in args.peers:  # each pipeline's chosen point once; draftsmith's earlier points beside the default
        for pipeline, entry in json.loads(path.read_text())["summary"].items():
            if tuple(entry["runs"]) in seen:
                continue
            seen.add(tuple(entry["runs"]))
            summary.append({"pipeline": pipeline, "setting": entry["setting"], "tokens": tokens, "dev_tau": [],
                            "heldout_tau": entry["heldout_tau"]["values"], "runs": entry["runs"],
                            "reused_from": str(path), "default": False})  # fmt: skip
    print(
        f"\nDeciding table at {tokens:,} tokens (held-out τ, mean ± sd over seeds; dev not judged in one run yet)"
    )
    for row in summary:
        s = spread(row["heldout_tau"])
        sd = f"± {s['sd']:.3f}" if s["sd"] is not None else ""
        print(f"  {row['pipeline']:12s} {s['mean']:.3f} {sd:8s} n={s['n']}  {' '.join(row['setting'])}")
    result = {"provenance": provenance(), "record": str(args.record), "tokens": tokens, "judge": "bench/heldout_tau.py "
              "--recipe quickstart --k 5 (40 held-out conversations)", "ablations": ablations, "summary": summary,
              "heldout_spread": [spread(row["heldout_tau"]) for row in summary]}  # fmt: skip
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
