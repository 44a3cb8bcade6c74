"""The block drafters' deciding table at 0.4M tokens: held-out τ over seeds and one interleaved dev run.

Reads the records ``bench/block_drafters.py`` wrote (``--records``: each its ``trained`` runs, one per draft
and seed, and the provenance of the code that trained them) and, with ``--dev``, one judging of the same
drafts on dev prompts the drafts never saw (``bench/vllm_engine.py --no-vllm``: draftsmith's decoder, the
target alone and every draft in one interleaved run, each at its own k). Groups the runs by draft, prints
held-out τ (mean ± sd over seeds) beside dev τ, acceptance by position, drafting ms a step, speedup and its
bound, and writes JSON with a ``summary`` list of ``{"pipeline", "kind", "setting", "tokens",
"heldout_tau": [...], "mean", "sd", "dev_tau"}``.

Held-out τ is the runs' final validation (the decoding walk on the quickstart's 16 held-out conversations,
k = the recipe's ``trainer.val_k`` 5 for every draft, so a block drafter's later slots are not counted there;
the dev run drafts whole blocks); every run here is the quickstart recipe with its draft section replaced
(``bench/block_drafters.py``), so the same 409,600 training positions.

    python bench/block_recipe.py --records runs/blocks/out/*.json bench/results/dflash_ablation_400k.json \\
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


def spread(values: list[float]) -> tuple[float | None, float | None]:
    return (
        statistics.fmean(values) if values else None,
        statistics.stdev(values) if len(values) > 1 else None,
    )


def dev_rows(report: dict | None) -> dict[str, dict]:
    """Draft name (the run folder's name) -> its row of a ``vllm_engine.py`` report's draftsmith side."""
    if report is None:
        return {}
    return {name.split(":", 1)[-1]: row for name, row in report["draftsmith"].items()}


def kind_of(draft: str) -> str:
    return draft.split("-", 1)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--records", nargs="+", type=Path, required=True, help="bench/block_drafters.py's JSON files"
    )
    p.add_argument("--dev", type=Path, help="bench/vllm_engine.py --no-vllm's JSON of the same drafts")
    p.add_argument("--out", default="bench/results/block_recipe.json")
    args = p.parse_args()
    runs = runs_of(args.records)
    dev_report = json.loads(args.dev.read_text()) if args.dev else None
    dev = dev_rows(dev_report)
    drafts = sorted({r["draft"] for r in runs.values()})
    summary = []
    print(f"\n{'draft':<20} {'seeds':>5} {'held-out τ':>15}  {'dev τ':>6} {'by position (dev)':<28} "
          f"{'draft ms':>8} {'×':>5} {'bound':>5}")  # fmt: skip
    for draft in drafts:
        mine = sorted((r for r in runs.values() if r["draft"] == draft), key=lambda r: r["seed"])
        taus = [r["state"]["tau"] for r in mine]
        mean, sd = spread(taus)
        row = dev.get(draft)
        summary.append({"pipeline": "draftsmith", "kind": kind_of(draft), "setting": draft, "tokens": TOKENS,
                        "seeds": [r["seed"] for r in mine], "heldout_tau": taus, "mean": mean, "sd": sd,
                        "heldout_by_position": [[r["state"].get(f"acc_pos_{i}") for i in range(1, 6)] for r in mine],
                        "dev_tau": [row["tau"]] if row else [],
                        "dev": None if row is None else {key: row.get(key) for key in (
                            "k", "tau", "per_position", "draft_ms_per_step", "speedup", "speedup_bound",
                            "tau_to_break_even", "exact_match")}})  # fmt: skip
        held = f"{mean:.3f} ± {sd:.3f}" if sd is not None else f"{mean:.3f}"
        by_pos = " ".join("-" if x is None else f"{x:.2f}" for x in (row or {}).get("per_position", [])[:5])
        print(f"{draft:<20} {len(mine):>5} {held:>15}  {(row or {}).get('tau', float('nan')):>6.3f} {by_pos:<28} "
              f"{(row or {}).get('draft_ms_per_step', float('nan')):>8.1f} {(row or {}).get('speedup', float('nan')):>5.2f} "
              f"{(row or {}).get('speedup_bound') or float('nan'):>5.2f}")  # fmt: skip
    if dev_report:
        alone = dev_report["draftsmith"].get("alone", {})
        s = dev_report["settings"]
        print(f"dev: {s['num_prompts']} prompts ({s['prompts']}, {s['order']}), {s['max_new_tokens']} new tokens, "
              f"target alone {alone.get('tokens_per_s', float('nan')):.1f} tok/s; commit "
              f"{dev_report['provenance']['commit']}")  # fmt: skip
    write_json(args.out, {"provenance": provenance(), "tokens": TOKENS, "records": [str(r) for r in args.records],
                          "dev_report": None if args.dev is None else str(args.dev),
                          "dev_settings": None if dev_report is None else dev_report["settings"],
                          "dev_provenance": None if dev_report is None else dev_report["provenance"],
                          "runs": runs, "summary": summary})  # fmt: skip


if __name__ == "__main__":
    main()
