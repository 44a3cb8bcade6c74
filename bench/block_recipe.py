"""The block drafters' deciding table at 0.4M tokens: held-out τ over seeds and one interleaved dev run.

Reads the records ``bench/block_drafters.py`` wrote (``--records``: each its ``trained`` runs, one per draft
and seed, and the provenance of the code that trained them) and, with ``--dev``, one judging of the same
drafts on dev prompts the drafts never saw (``bench/vllm_engine.py --no-vllm``: draftsmith's decoder, the
target alone and every draft in one interleaved run, each at its own k). Groups the runs by draft, prints
held-out τ (mean ± sd over seeds) beside dev τ, acceptance by position, drafting ms a step, speedup and its
bound, and writes JSON with a ``summary`` list of ``{"pipeline", "kind", "setting", "tokens",
"heldout_tau": [...], "mean", "sd", "dev_tau"}``.

Held-out τ is the held-out judge's (``--judge``: ``bench/heldout_tau.py --recipe quickstart`` over the heads,
the decoding walk on the quickstart's held-out conversations with the float32 target, k 5 for every draft, so a
block drafter's later slots are not counted there; the dev run drafts whole blocks), else a run's final
validation (the same walk on its bf16 target). Every draftsmith run here is the quickstart recipe with its draft
section replaced (``bench/block_drafters.py``), so the same 409,600 training positions; the peers' DFlash
(``--peers``: ``bench/peer_training.py --draft dflash``) train on the same rows and are judged alike.

    python bench/heldout_tau.py --recipe quickstart --draft runs/blocks/*/draft --out bench/results/block_heldout.json
    python bench/block_recipe.py --records bench/results/block_seeds_400k/*.json \\
        bench/results/dflash_ablation_400k.json bench/results/dspark_400k.json \\
        --judge bench/results/block_heldout.json --peers bench/results/peer_dflash_400k.json \\
        --dev bench/results/block_recipe_dev.json --out bench/results/block_recipe.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from benchlib.records import provenance, write_json

TOKENS = 409_600
"""The quickstart recipe's training positions: 800 steps of one packed 512-token row."""
SEED = re.compile(r"^(?P<draft>.+?)-seed(?P<seed>\d+)$")


def runs_of(records: list[Path]) -> dict[str, dict]:
    """Run name -> its record (draft, seed, held-out state, the commit and machine that trained it); a run in
    several files is kept once, from the file that trained it (the one with its wall time), else the last."""
    runs: dict[str, dict] = {}
    for path in records:
        data = json.loads(path.read_text())
        for name, record in data.get("trained", {}).items():
            state = record.get("train_state") or {}
            if not state.get("step"):
                continue  # not trained to the end
            m = SEED.match(name)
            run = {"draft": record.get("draft") or (m["draft"] if m else name),
                   "seed": record.get("seed", int(m["seed"]) if m else 0), "state": state,
                   "wall_s": record.get("wall_s"), "record": str(path),
                   "commit": data["provenance"].get("commit"), "machine": data["provenance"].get("machine")}  # fmt: skip
            if name not in runs or run["wall_s"] is not None:
                runs[name] = run
    return runs


def judged(runs: dict[str, dict], reports: list[Path]) -> None:
    """Replace each run's held-out τ (its training's last validation, on the bf16 target) by the held-out judge's
    (``bench/heldout_tau.py --recipe quickstart``: the same rows and walk on the float32 target, the judge the
    peers' heads get), keeping the validation's as ``val_tau``; a head is its run folder's ``draft/``."""
    for path in reports:
        for head, result in json.loads(path.read_text())["drafts"].items():
            run = runs.get(Path(head).parent.name if Path(head).name == "draft" else Path(head).name)
            if run is None:
                continue
            walk = result["walk"]
            run["val_tau"] = run["state"]["tau"]
            run["state"] = {
                "tau": walk["tau"],
                **{f"acc_pos_{i + 1}": a for i, a in enumerate(walk["per_position"])},
            }
            run["judge"] = str(path)


def peer_runs(records: list[Path]) -> dict[str, dict]:
    """Run name -> its record, from ``bench/peer_training.py --draft dflash`` JSON (each run judged on the same
    held-out rows by ``bench/heldout_tau.py`` right after it trained); a run ``NAME-seedN`` is NAME's seed N."""
    runs: dict[str, dict] = {}
    for path in records:
        data = json.loads(path.read_text())
        if (data.get("budget") or {}).get("draft") != "dflash":
            raise SystemExit(f"{path}: not a DFlash record of bench/peer_training.py (--draft dflash)")
        for name, record in data.get("train", {}).items():
            judge = record.get("judge") or {}
            if record.get("returncode") != 0 or "tau" not in judge:
                continue  # not trained to the end, or not judged
            m = SEED.match(name)
            runs[name] = {"draft": f"{m['draft'] if m else name} (DFlash)", "seed": int(m["seed"]) if m else 0,
                          "state": {"tau": judge["tau"], **{f"acc_pos_{i + 1}": a
                                                            for i, a in enumerate(judge["per_position"])}},
                          "wall_s": record.get("wall_s"), "record": str(path),
                          "commit": (record.get("provenance") or data["provenance"]).get("commit"),
                          "machine": data["provenance"].get("machine")}  # fmt: skip
    return runs


def spread(values: list[float]) -> tuple[float | None, float | None]:
    return (
        statistics.fmean(values) if values else None,
        statistics.stdev(values) if len(values) > 1 else None,
    )


def dev_rows(reports: dict[Path, dict]) -> dict[str, dict]:
    """Draft name (the run folder's name; a peer's ``NAME (DFlash)``) -> its row of the ``vllm_engine.py``
    reports' draftsmith side, from the first report that holds it, with ``report`` naming that run (each draft's
    speedup is against the target alone of its own interleaved run) and, where that run also served the draft
    with vLLM, vLLM's acceptance length at batch 1 (``vllm_tau``, beside draftsmith's τ over the steps that
    drafted: ``tau_drafting``), its acceptance by position and whether its outputs equal its target alone's."""
    rows: dict[str, dict] = {}
    for path, report in reports.items():
        served = report.get("vllm") or {}
        for name, row in report["draftsmith"].items():
            vllm = served.get(name) or {}
            engine = {"vllm_tau": vllm["batch_1"].get("tau"), "vllm_per_position": vllm["batch_1"].get("per_position"),
                      "vllm_exact_match": vllm.get("exact_match")} if vllm.get("batch_1") else {}  # fmt: skip
            rows.setdefault(name.split(":", 1)[-1], {**row, **engine, "report": str(path)})
    return rows


def kind_of(draft: str) -> str:
    return draft.split("-", 1)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--records", nargs="+", type=Path, required=True, help="bench/block_drafters.py's JSON files"
    )
    p.add_argument("--peers", nargs="*", type=Path, default=[],
                   help="bench/peer_training.py --draft dflash's JSON files (the peers' DFlash, judged alike)")  # fmt: skip
    p.add_argument("--judge", nargs="*", type=Path, default=[],
                   help="bench/heldout_tau.py --recipe quickstart's JSON of the runs' heads: their held-out τ "
                   "by the judge the peers get (else their training's last validation)")  # fmt: skip
    p.add_argument("--dev", nargs="*", type=Path, default=[],
                   help="bench/vllm_engine.py --no-vllm's JSON of the same drafts (several: separate interleaved "
                   "runs, a draft's row from the first that holds it)")  # fmt: skip
    p.add_argument("--out", default="bench/results/block_recipe.json")
    args = p.parse_args()
    runs = runs_of(args.records)
    judged(runs, args.judge)
    runs |= peer_runs(args.peers)
    dev_reports = {path: json.loads(path.read_text()) for path in args.dev}
    dev = dev_rows(dev_reports)
    drafts = sorted({r["draft"] for r in runs.values()})
    summary = []
    print(f"\n{'draft':<20} {'seeds':>5} {'held-out τ':>15}  {'dev τ':>6} {'by position (dev)':<28} "
          f"{'draft ms':>8} {'×':>5} {'bound':>5} {'vLLM τ':>6}")  # fmt: skip
    for draft in drafts:
        mine = sorted((r for r in runs.values() if r["draft"] == draft), key=lambda r: r["seed"])
        taus = [r["state"]["tau"] for r in mine]
        mean, sd = spread(taus)
        row = dev.get(draft)
        pipeline = draft.split()[0].split("-")[0] if draft.endswith("(DFlash)") else "draftsmith"
        summary.append({"pipeline": pipeline, "kind": "dflash" if pipeline != "draftsmith" else kind_of(draft), "setting": draft, "tokens": TOKENS,
                        "seeds": [r["seed"] for r in mine], "heldout_tau": taus, "mean": mean, "sd": sd,
                        "heldout_by_position": [[r["state"].get(f"acc_pos_{i}") for i in range(1, 6)] for r in mine],
                        "dev_tau": [row["tau"]] if row else [],
                        "dev": None if row is None else {key: row.get(key) for key in (
                            "k", "tau", "per_position", "draft_ms_per_step", "speedup", "speedup_bound",
                            "tau_to_break_even", "exact_match", "tau_drafting", "vllm_tau", "vllm_per_position",
                            "vllm_exact_match", "report")}})  # fmt: skip
        held = f"{mean:.3f} ± {sd:.3f}" if sd is not None else f"{mean:.3f}"
        by_pos = " ".join("-" if x is None else f"{x:.2f}" for x in (row or {}).get("per_position", [])[:5])
        print(f"{draft:<20} {len(mine):>5} {held:>15}  {(row or {}).get('tau', float('nan')):>6.3f} {by_pos:<28} "
              f"{(row or {}).get('draft_ms_per_step', float('nan')):>8.1f} {(row or {}).get('speedup', float('nan')):>5.2f} "
              f"{(row or {}).get('speedup_bound') or float('nan'):>5.2f} "
              f"{(row or {}).get('vllm_tau') or float('nan'):>6.3f}")  # fmt: skip
    for path, dev_report in dev_reports.items():
        alone = dev_report["draftsmith"].get("alone", {})
        s = dev_report["settings"]
        print(f"dev {path}: {s['num_prompts']} prompts ({s['prompts']}, {s['order']}), {s['max_new_tokens']} new "
              f"tokens, target alone {alone.get('tokens_per_s', float('nan')):.1f} tok/s; commit "
              f"{dev_report['provenance']['commit']}")  # fmt: skip
    write_json(args.out, {"provenance": provenance(), "tokens": TOKENS, "records": [str(r) for r in args.records + args.peers],
                          "judge": [str(r) for r in args.judge],
                          "dev_reports": {str(path): {"settings": r["settings"], "provenance": r["provenance"]}
                                          for path, r in dev_reports.items()},
                          "runs": runs, "summary": summary})  # fmt: skip


if __name__ == "__main__":
    main()
