"""The EAGLE-3 recipe issue's tables: draftsmith's ablations at 0.4M tokens beside every peer's chosen point.

Reads the ablation record written by ``bench/peer_training.py`` (runs ``draftsmith-r45*``: draftsmith's Muon point,
one packed 512-token row a step, with one change each, then the keeper at more seeds; each judged by
``bench/heldout_tau.py`` on the quickstart's held-out rows right after it trained) and the peers' 3-seed records
of the 0.4M sweep (``peer_seeds_400k.json``; the same data stage, capture and held-out judge, so their held-out
figures are reused, not retrained). Prints the ablation table and the deciding table, writes JSON with a
``summary`` list of ``{"pipeline", "setting", "tokens", "dev_tau", "heldout_tau"}`` (the default marked
``"default": true``). A peer whose runs the record holds too (retrained on the record's machine, same data,
capture and judge) takes its held-out figures from the record. dev τ comes from ``--dev``: one interleaved
``draftsmith eval`` report over the heads (each named by its path under ``WORK/runs/RUN/``), on dev prompts
no head trained on; a peer's dev figures from the earlier sweep runs (12 prompts, another run) are not
mixed in.

    python bench/eagle3_recipe.py --record bench/results/eagle3_recipe_400k.json \\
        --peers bench/results/peer_seeds_400k.json bench/results/peer_seeds_400k_muon.json \\
        --dev bench/results/eagle3_dev_400k.json --out bench/results/eagle3_recipe.json

``--larger RECORD ...``: ``bench/peer_training.py`` records at a larger budget (the same data pool and judge;
several records of one budget, e.g. a seed each, are read as one) that trained the default (``KEEPER`` and its
``-seedN`` runs) and peers' chosen points (a point's first run name and its ``-seedN`` runs); each point found
there is a summary row at that budget, its held-out τ from the record's own judge, its dev τ from
``--larger-dev`` (one interleaved report over those heads, or several where a session's end split the dev run:
greedy τ does not depend on what else ran), kept apart from the 0.4M heads of the same names.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchlib.records import provenance, write_json

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
    "r45regen": (
        "the default on the target's own answers: the same 1,886 prompts regenerated through vLLM (bench/regen_pool.py)",
        KEEPER,
    ),
    # on the default, each in an --ablations record beside that record's own run of the default (bench/eagle3_ablations.sh)
    "r45dopt": (
        "the default with speculators' optimizer split: AdamW lr 1e-4 wd 0.01 on the rest, Muon lr 1e-3, clip 1.0",
        KEEPER,
    ),
    "r45dlin": ("the default with speculators' schedule: linear decay to 0, warm-up 1 % (8 steps)", KEEPER),
    "r45dnoise": ("the default with uniform feature noise +-0.05 on the tapped states", KEEPER),
    "r45ddpace": ("the default with step_weighting dpace (D-PACE on the TTT chain, alpha 0.5)", KEEPER),
    "r45dlk": ("the default with loss lk_hybrid (LK^lambda, eta 3)", KEEPER),
}
MUON_POINT = "draftsmith-b1muon"
"""The sweep's run of the same setting as ``BASE``: its seed-0 record stands in where ``BASE`` did not run."""


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) if values else None,
            "sd": statistics.stdev(values) if len(values) > 1 else None, "n": len(values), "values": values}  # fmt: skip


def dev_taus(report: dict, runs: dict) -> dict[str, float]:
    """Run name -> τ of each head in a ``draftsmith eval`` report, the run named by a part of the head's path."""
    taus = {}
    for draft in report["drafts"]:
        names = [part for part in Path(draft["name"]).parts if part in runs]
        if names:
            taus[names[-1]] = draft["tau"]
    return taus


def dev_judge(report: dict | None, path: Path) -> dict | None:
    """What the dev judge was: its prompts and settings, its code's commit, machine, and the target's speed."""
    if report is None:
        return None
    s = report["settings"]
    return {"report": str(path), "prompts": s["prompts"], "num_prompts": s["num_prompts"], "order": s["order"],
            "max_new_tokens": s["max_new_tokens"], "k": s["k"], "greedy": report["greedy"],
            "provenance": report.get("provenance"), "hardware": report["hardware"],
            "exact": all(d["exact_match"] for d in report["drafts"]),
            "speedup": {d["name"]: d["speedup"] for d in report["drafts"]}}  # fmt: skip


def seeds_of(first: str, runs: dict) -> list[str]:
    """``first`` and its ``-seedN`` runs (N = 1, 2, ...) that ``runs`` holds, in seed order."""
    found = [first] if first in runs else []
    return found + sorted(
        (n for n in runs if n.startswith(f"{first}-seed") and n.removeprefix(f"{first}-seed").isdigit()),
        key=lambda n: int(n.removeprefix(f"{first}-seed")),
    )


def larger_budget_rows(
    records: list[tuple[Path, dict]], points: list[dict], dev: dict[str, float]
) -> list[dict]:
    """Summary rows at each larger budget of ``records`` (path, record): the default and every point of ``points``
    (the 0.4M summary rows, each named by its first run) that the records trained and judged at that budget."""
    budgets: dict[int, dict] = {}
    for path, record in records:
        judged = {n: r for n, r in record["train"].items() if (r.get("judge") or {}).get("tau")}
        for name, run in judged.items():
            budgets.setdefault(record["budget"]["tokens_asked"], {})[name] = (run, str(path))
    rows = []
    for tokens, runs in sorted(budgets.items()):
        for point in points:
            names = seeds_of(KEEPER if point.get("default") else point["runs"][0], runs)
            if not names:
                continue
            rows.append({"pipeline": point["pipeline"], "setting": point["setting"], "tokens": tokens,
                         "dev_tau": [dev[n] for n in names if n in dev],
                         "heldout_tau": [runs[n][0]["judge"]["tau"] for n in names], "runs": names,
                         "default": bool(point.get("default")), "trained_in": sorted({runs[n][1] for n in names})})  # fmt: skip
    return rows


def ablation_rows(
    runs: dict, references: dict[str, float], dev: dict[str, float], record: Path
) -> list[dict]:
    """The ablation rows of one record's judged ``runs`` (draftsmith's, not a ``-seedN``), each with its held-out τ
    against the run ``CHANGES`` names (its τ from ``references``; an unlisted run is compared with ``BASE``)."""
    rows = []
    for name, run in runs.items():
        label = name.removeprefix("draftsmith-")
        if "-seed" in label or not name.startswith("draftsmith-"):  # a seed, or a peer retrained here
            continue
        tau = run["judge"]["tau"]
        change, against = CHANGES.get(label, ("; ".join(run.get("overrides", [])), BASE))
        delta = tau - references[against] if against and against in references else None
        rows.append({"run": name, "change": change, "heldout_tau": tau, "against": against, "delta": delta,
                     "dev_tau": dev.get(name), "per_position": run["judge"].get("per_position"), "record": str(record),
                     "commit": run["provenance"]["commit"], "machine": run["provenance"]["machine"]["cpu"],
                     "flags": run["provenance"]["machine"].get("flags"), "date": run["provenance"]["date"],
                     "wall_s": run.get("wall_s")})  # fmt: skip
    return rows


def judged_runs(record: dict) -> dict:
    return {name: run for name, run in record["train"].items() if (run.get("judge") or {}).get("tau")}


def existing(*paths: str) -> list[Path]:
    return [Path(p) for p in paths if Path(p).exists()]


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
    p.add_argument(
        "--dev",
        type=Path,
        nargs="+",
        default=[
            Path("bench/results/eagle3_dev_400k.json"),
            Path("bench/results/eagle3_dev_400k_regen.json"),
        ],
        help="the dev judge: draftsmith eval report.json files over the heads, the first the one interleaved run "
        "of the deciding table, later ones for ablations (greedy τ does not depend on what else ran)",
    )
    p.add_argument("--larger", type=Path, nargs="*", default=existing("bench/results/eagle3_recipe_1600k.json"),
                   help="peer_training records at a larger token budget (the default and peers' points trained there)")  # fmt: skip
    p.add_argument("--larger-dev", type=Path, nargs="*", default=sorted(Path("bench/results").glob("eagle3_dev_1600k*.json")),
                   help="draftsmith eval report.json files over the larger budget's heads: one interleaved run, or "
                   "several where a machine's end split them (greedy τ does not depend on what else ran; each "
                   "report's own target-alone speed is kept with it)")  # fmt: skip
    p.add_argument("--ablations", type=Path, nargs="*", default=existing("bench/results/eagle3_ablations_400k.json"),
                   help="peer_training records of ablations at the same budget, each with its own run of the default "
                   "(KEEPER) that its rows are compared with: another machine's, whose precision may differ")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/eagle3_recipe.json"))
    args = p.parse_args(argv)
    record = json.loads(args.record.read_text())
    dev_reports = [json.loads(path.read_text()) for path in args.dev if path.exists()]
    dev = {}
    for report in dev_reports:
        dev |= dev_taus(report, record["train"])
    dev_report = dev_reports[0] if dev_reports else None
    tokens = record["budget"]["tokens_asked"]
    runs = judged_runs(record)
    references = {name: run["judge"]["tau"] for name, run in runs.items()}
    base_from = str(args.record)
    if BASE not in references:  # the same setting, seed 0, from the sweep (the same data, capture and judge)
        for path in args.peers:
            judged = json.loads(path.read_text())["summary"].get("draftsmith", {})
            if judged.get("runs", [None])[0] == MUON_POINT:
                references[BASE], base_from = judged["heldout_tau"]["values"][0], f"{path} ({MUON_POINT})"
    base = references[BASE]

    print(
        f"Ablations at {tokens:,} tokens, one seed each (held-out judge, k 5); {BASE} {base:.3f} from {base_from}"
    )
    ablations = ablation_rows(runs, references, dev, args.record)
    for path in args.ablations:  # another machine's ablations, against its own run of the default
        other = judged_runs(json.loads(path.read_text()))
        if other.keys() - {KEEPER} and KEEPER not in other:
            raise SystemExit(f"{path}: no judged run of the default ({KEEPER}) to compare its ablations with")
        ablations += ablation_rows(other, {n: r["judge"]["tau"] for n, r in other.items()}, {}, path)
    for row in ablations:
        against = row["against"]
        shown = (
            f"{row['delta']:+6.3f} vs {against.removeprefix('draftsmith-')}"
            if row["delta"] is not None
            else ""
        )
        dev_cell = f"dev {row['dev_tau']:.3f}" if row["dev_tau"] is not None else ""
        where = "" if row["record"] == str(args.record) else f" [{Path(row['record']).name}]"
        label = row["run"].removeprefix("draftsmith-")
        print(f"  {label:10s} {row['heldout_tau']:6.3f} {shown:18s} {dev_cell:9s} {row['change']}{where}")

    keeper = [runs[n]["judge"]["tau"] for n in (KEEPER, f"{KEEPER}-seed1", f"{KEEPER}-seed2") if n in runs]
    keeper_runs = [n for n in (KEEPER, f"{KEEPER}-seed1", f"{KEEPER}-seed2") if n in runs]
    summary = [{"pipeline": "draftsmith", "setting": DEFAULT_SETTING, "tokens": tokens,
                "dev_tau": [dev[n] for n in keeper_runs if n in dev], "heldout_tau": keeper, "default": True,
                "runs": keeper_runs}]  # fmt: skip
    seen = set()
    for (
        path
    ) in args.peers:  # each pipeline's chosen point once; draftsmith's earlier points beside the default
        for pipeline, entry in json.loads(path.read_text())["summary"].items():
            if tuple(entry["runs"]) in seen:
                continue
            seen.add(tuple(entry["runs"]))
            row = {"pipeline": pipeline, "setting": entry["setting"], "tokens": tokens,
                   "dev_tau": [dev[n] for n in entry["runs"] if n in dev], "runs": entry["runs"], "default": False}  # fmt: skip
            if all(n in runs for n in entry["runs"]):  # retrained here: the record's own judge
                row.update(
                    heldout_tau=[runs[n]["judge"]["tau"] for n in entry["runs"]],
                    retrained_in=str(args.record),
                )
            else:
                row.update(heldout_tau=entry["heldout_tau"]["values"], reused_from=str(path))
            summary.append(row)
    larger = [(path, json.loads(path.read_text())) for path in args.larger]
    larger_reports = [json.loads(path.read_text()) for path in args.larger_dev]
    larger_dev = {}
    for report in larger_reports:  # a head judged in two reports takes the later one's τ (the same, greedy)
        for _, larger_record in larger:
            larger_dev |= dev_taus(report, larger_record["train"])
    summary += larger_budget_rows(larger, [row for row in summary if row["default"] or row["pipeline"] != "draftsmith"],
                                  larger_dev)  # fmt: skip
    print(
        f"\nDeciding table (τ, mean ± sd over seeds; dev: {len(dev)} heads judged in one run at {tokens:,} tokens)"
    )
    for row in summary:
        cells = []
        for key in ("dev_tau", "heldout_tau"):
            s = spread(row[key])
            sd = f" ± {s['sd']:.3f}" if s["sd"] is not None else ""
            cells.append(
                f"{key.split('_')[0]} {s['mean']:.3f}{sd} (n={s['n']})"
                if s["n"]
                else f"{key.split('_')[0]} —"
            )
        print(
            f"  {row['tokens']:>9,} {row['pipeline']:12s} {cells[0]:28s} {cells[1]:28s} {' '.join(row['setting'])}"
        )
    result = {"provenance": provenance(), "record": str(args.record), "tokens": tokens, "judge": "bench/heldout_tau.py "
              "--recipe quickstart --k 5 (40 held-out conversations)", "base": {"run": BASE, "heldout_tau": base, "from": base_from}, "ablations": ablations, "summary": summary,
              "heldout_spread": [spread(row["heldout_tau"]) for row in summary],
              "dev_spread": [spread(row["dev_tau"]) for row in summary], "dev_judge": dev_judge(dev_report, args.dev[0]),
              "dev_reports": [str(p) for p in args.dev if p.exists()], "larger": [str(p) for p in args.larger],
              "ablation_records": [str(p) for p in args.ablations],
              "larger_dev_judges": [dev_judge(r, path) for r, path in zip(larger_reports, args.larger_dev)]}  # fmt: skip
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
