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
CHANGES = {  # run label -> (what it changes, the run it is compared with)
    "r45base": ("none: draftsmith's Muon point (trainer.batch_size=1, optim.name=muon), this machine", None),
    "r45norms": ("EAGLE-3.1 norms: norm_before_fc + norm_output + norm_before_residual", BASE),
    "r45fcres": (
        "the default less norm_output (llama.cpp's two: norm_before_fc + norm_before_residual)",
        KEEPER,
    ),
    "r45out": ("norm_output alone", BASE),
    "r45dpace": ("step_weighting dpace (D-PACE, alpha 0.5)", BASE),
    "r45walk": ("the default with step_weighting walk (ours: D-PACE on the draft's greedy hits)", KEEPER),
    "r45lk": ("loss lk_hybrid (LK^lambda, eta 3)", BASE),
    "r45opt": (
        "speculators' optimizer split: AdamW lr 1e-4 wd 0.01 on the rest, Muon lr 1e-3, clip 1.0",
        BASE,
    ),
    "r45lin": ("speculators' schedule: linear decay to 0, warm-up 1 % (8 steps)", BASE),
    "r45noise": ("uniform feature noise +-0.05 on the tapped states", BASE),
}
MUON_POINT = "draftsmith-b1muon"
"""The sweep's run of the same setting as ``BASE``: its seed-0 record stands in where ``BASE`` did not run."""


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
    references = {name: run["judge"]["tau"] for name, run in runs.items()}
    base_from = str(args.record)
    if BASE not in references:  # the same setting, seed 0, from the sweep (the same data, capture and judge)
        for path in args.peers:
            judged = json.loads(path.read_text())["summary"].get("draftsmith", {})
            if judged.get("runs", [None])[0] == MUON_POINT:
                references[BASE], base_from = judged["heldout_tau"]["values"][0], f"{path} ({MUON_POINT})"
    base = references[BASE]

    ablations = []
    print(
        f"Ablations at {tokens:,} tokens, one seed each (held-out judge, k 5); {BASE} {base:.3f} from {base_from}"
    )
    for name, run in runs.items():
        label = name.removeprefix("draftsmith-")
        if "-seed" in label:
            continue
        tau = run["judge"]["tau"]
        change, against = CHANGES.get(label, ("; ".join(run.get("overrides", [])), BASE))
        delta = tau - references[against] if against else None
        row = {"run": name, "change": change, "heldout_tau": tau, "against": against, "delta": delta,
               "per_position": run["judge"].get("per_position"), "commit": run["provenance"]["commit"],
               "machine": run["provenance"]["machine"]["cpu"], "date": run["provenance"]["date"],
               "wall_s": run.get("wall_s")}  # fmt: skip
        ablations.append(row)
        shown = f"{delta:+6.3f} vs {against.removeprefix('draftsmith-')}" if against else ""
        print(f"  {label:10s} {tau:6.3f} {shown:18s} {row['change']}")

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
              "--recipe quickstart --k 5 (40 held-out conversations)", "base": {"run": BASE, "heldout_tau": base, "from": base_from}, "ablations": ablations, "summary": summary,
              "heldout_spread": [spread(row["heldout_tau"]) for row in summary]}  # fmt: skip
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
