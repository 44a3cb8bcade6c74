"""Eval reports: one JSON-ready dict, printed as a table and written as DIR/report.json and DIR/report.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from draftsmith import files
from draftsmith.eval.harness import BASELINE, GENERATE, EvalResult, MethodResult
from draftsmith.eval.mirror_stats import MirrorStats
from draftsmith.eval.numbers import cell, json_number, json_ratio
from draftsmith.eval.plots import PLOT_NAME
from draftsmith.eval.stats import RunStats, SpeedupBound
from draftsmith.loading import cpu_model

_METRICS = """\
τ (tau)   tokens committed per target verify forward, the target's bonus/correction token included
          (mean of accepted + 1 over verify steps; 1.0 for the target alone).
α (alpha) accepted draft tokens / proposed draft tokens.
per-position acceptance: P(draft token i accepted | every draft token before it accepted).
tok/s     new tokens / wall-clock seconds of generation (prefill included), after warm-up.
speedup   tok/s of the draft / tok/s of the target alone, same prompts, settings and process.
vs-gen    tok/s / tok/s of the target's own transformers generate (greedy or sampled alike, PyTorch's stock
          kernels, interleaved in the same run): the speedup over what a user runs without draftsmith.
bound     the speedup the measured acceptance and costs allow (chain drafting): E / (draft + verify), where
          E = mean over verify steps of 1 + Σ_{i=1..k} Π_{j≤i} a_j (a_j: per-position acceptance; k: the
          step's chain length, --k or each step's under --k auto) and draft, verify = measured seconds of a
          step's draft call, verify pass / a decode step of the target alone (prefill excluded). — for
          trees and mirror decoding, whose tokens per step follow other formulas.
eff       measured speedup / bound: the share of the bound the run delivered (time between the steps and
          prefill are outside the bound). Low eff: the decoder falls short; low bound: the draft
          (acceptance, or what drafting costs).
exact     greedy only: every output equals the target alone's, token for token (— when sampling)."""

MODES = (MirrorStats,)
"""Decoding modes that measure more than acceptance and timing (``RunStats.mode``): each brings its entry
of a draft's report, its table and its lines of the metric definitions."""

METRICS = "\n".join([_METRICS, *(mode.metrics for mode in MODES)])
"""The metric definitions: ``draftsmith eval --help``, report.md, the card."""


def hardware_description(device: torch.device, dtype: torch.dtype) -> str:
    """What the numbers were measured on: accelerator or CPU model, threads, torch, device and dtype."""
    parts = []
    if device.type == "cuda":
        parts.append(f"GPU {torch.cuda.get_device_name(device)}")
    parts.append(f"CPU {cpu_model()} ({os.cpu_count()} logical cores)")
    parts.append(f"torch {torch.__version__} with {torch.get_num_threads()} threads")
    parts.append(f"device {device}, dtype {str(dtype).removeprefix('torch.')}")
    return "; ".join(parts)


def _timing_fields(stats: RunStats) -> dict:
    t = stats.timing
    return {
        "tokens_per_s": json_number(t.tokens_per_s),
        "new_tokens": t.new_tokens,
        "seconds": t.seconds,
        "prefill_seconds": t.prefill_seconds,
        "draft_seconds": t.draft_seconds,
        "verify_seconds": t.verify_seconds,
        "target_forwards": t.target_forwards,
        "generations": t.generations,
    }


NO_BOUND = {
    "tree": "no bound: it is for chain drafting; a tree's tokens per step depend on its shape, not on "
    "per-position rates alone",
    **{mode.key: mode.no_bound for mode in MODES},
}


def _speedups(stats: RunStats, base: RunStats, decoding: str) -> dict:
    """The measured speedup, the bound its steps allow (chain drafting only) and measured / bound."""
    speedup = json_ratio(stats.timing.tokens_per_s, base.timing.tokens_per_s)
    bound = SpeedupBound.measure(stats, base) if decoding == "chain" else None
    return {
        "speedup": speedup,
        "speedup_bound": None if bound is None else json_number(bound.speedup),
        "efficiency": None if bound is None or speedup is None else json_number(bound.efficiency(speedup)),
    }


def _bound_inputs(stats: RunStats, base: RunStats, decoding: str) -> dict:
    """What the bound was computed from, or why there is none."""
    bound = SpeedupBound.measure(stats, base) if decoding == "chain" else None
    if bound is None:
        return {"note": NO_BOUND.get(decoding, "no bound: no decode step was timed")}
    return {
        "expected_tokens": json_number(bound.expected_tokens),
        "chain_lengths": {str(n): c for n, c in bound.chain_lengths.items()},
        "mean_chain_length": json_number(bound.mean_chain_length),
        "draft_cost": json_number(bound.draft_cost),
        "draft_cost_per_token": json_number(bound.draft_cost_per_token),
        "verify_cost": json_number(bound.verify_cost),
        "plain_step_ms": 1000 * bound.plain_step_seconds,
    }


def _vs_generate(stats: RunStats, generate: MethodResult | None, category: str | None = None) -> dict:
    """The speedup over transformers' own ``generate`` on the same prompts (none when it did not run)."""
    if generate is None:
        return {}
    base = generate.total if category is None else generate.categories[category]
    return {"speedup_vs_generate": json_ratio(stats.timing.tokens_per_s, base.timing.tokens_per_s)}


def _draft_entry(
    draft: MethodResult,
    baseline: MethodResult,
    categories: list[str],
    settings: dict,
    generate: MethodResult | None = None,
) -> dict:
    acc = draft.total.acceptance
    entry = {
        "name": draft.name,
        "tau": json_number(acc.tau),
        "tau_drafting": json_number(acc.tau_drafting),
        "alpha": json_number(acc.alpha),
        "per_position": [json_number(x) for x in acc.per_position],
        **_timing_fields(draft.total),
        **_speedups(draft.total, baseline.total, draft.decoding),
        **_vs_generate(draft.total, generate),
        "bound": _bound_inputs(draft.total, baseline.total, draft.decoding),
        "exact_match": draft.exact_match,
        "mismatched_prompts": draft.mismatched_prompts,
        "acceptance": {**acc.to_dict(), "proposed_at": acc.proposed_at, "accepted_at": acc.accepted_at},
        "categories": {},
    }
    mode = draft.total.mode
    if mode is not None:
        entry[mode.key] = mode.entry(draft.total.timing, baseline.total.timing, settings)
    if draft.chosen_k:  # k = "auto": verify steps per chosen k (0 = plain decoding)
        entry["chosen_k"] = {str(k): n for k, n in sorted(draft.chosen_k.items())}
    for cat in categories:
        stats, base = draft.categories[cat], baseline.categories[cat]
        entry["categories"][cat] = {
            "tau": json_number(stats.acceptance.tau),
            "alpha": json_number(stats.acceptance.alpha),
            "tokens_per_s": json_number(stats.timing.tokens_per_s),
            **_speedups(stats, base, draft.decoding),
            **_vs_generate(stats, generate, cat),
            "exact_match": draft.category_exact.get(cat),
            "new_tokens": stats.timing.new_tokens,
        }
    return entry


def build_report(result: EvalResult, target: str, settings: dict, hardware: str) -> dict:
    """The report as a JSON-ready dict (the schema of report.json)."""
    base, generate = result.baseline, result.generate
    baseline = _plain_entry(base, result.categories, generate)
    report = {
        "target": target,
        "settings": settings,
        "hardware": hardware,
        "greedy": result.greedy,
        "categories": result.categories,
        "baseline": baseline,
        "drafts": [_draft_entry(d, base, result.categories, settings, generate) for d in result.drafts],
        "truncated_generations": base.truncated,
    }
    if generate is not None:
        report["generate"] = {
            **_plain_entry(generate, result.categories, generate),
            "speedup": json_ratio(generate.total.timing.tokens_per_s, base.total.timing.tokens_per_s),
            "exact_match": generate.exact_match,
            "mismatched_prompts": generate.mismatched_prompts,
        }
    return report


def _plain_entry(method: MethodResult, categories: list[str], generate: MethodResult | None) -> dict:
    """A method without a draft (the target alone, or transformers' generate): timing, overall and per category."""
    entry = {"name": method.name, **_timing_fields(method.total), **_vs_generate(method.total, generate)}
    entry["categories"] = {}
    for cat in categories:
        stats = method.categories[cat]
        entry["categories"][cat] = {
            "tokens_per_s": json_number(stats.timing.tokens_per_s),
            "new_tokens": stats.timing.new_tokens,
            "seconds": stats.timing.seconds,
            "generations": stats.timing.generations,
            **_vs_generate(stats, generate, cat),
        }
    return entry


def _exact(x: bool | None) -> str:
    return "—" if x is None else ("yes" if x else "NO")


def _row(name: str, category: str, s: dict) -> list[str]:
    return [
        name,
        category,
        cell(s["tau"], ".2f"),
        cell(s["alpha"], ".2f"),
        cell(s["tokens_per_s"], ".1f"),
        cell(s["speedup"], ".2f"),
        cell(s.get("speedup_vs_generate"), ".2f"),
        cell(s.get("speedup_bound"), ".2f"),
        cell(s.get("efficiency"), ".2f"),
        _exact(s["exact_match"]),
    ]


def table_rows(report: dict) -> list[list[str]]:
    """Rows of (draft, category, τ, α, tok/s, speedup, vs-gen, bound, eff, exact): an 'all' row per method,
    then its categories; transformers' generate (when it ran) after the target alone."""
    cats = report["categories"] if len(report["categories"]) > 1 else []
    base = report["baseline"]
    alone = {"tau": 1.0, "alpha": None, "speedup": 1.0, "exact_match": None}
    rows = [_row(BASELINE, "all", {**alone, **base})]
    rows += [_row(BASELINE, c, {**alone, **base["categories"][c]}) for c in cats]
    gen = report.get("generate")
    if gen is not None:
        rows.append(_row(GENERATE, "all", {**alone, **gen}))
        for c in cats:
            rate = gen["categories"][c]["tokens_per_s"]
            speedup = json_ratio(rate, base["categories"][c]["tokens_per_s"])
            rows.append(_row(GENERATE, c, {**alone, **gen["categories"][c], "speedup": speedup}))
    for d in report["drafts"]:
        rows.append(_row(d["name"], "all", d))
        rows += [_row(d["name"], c, d["categories"][c]) for c in cats]
    return rows


HEADER = ["draft", "category", "τ", "α", "tok/s", "speedup", "vs-gen", "bound", "eff", "exact"]


def format_table(report: dict) -> str:
    """A plain-text table for the terminal."""
    rows = [HEADER, *table_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for mode in MODES:
        rows = mode.rows(report)
        if rows:
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines += ["", mode.title]
            lines += [
                "  ".join(c.ljust(w) if i < 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                for r in rows
            ]
    return "\n".join(lines)


BOUND_HEADER = [
    "draft",
    "k: steps",
    "E",
    "τ",
    "draft cost",
    "verify cost",
    "plain step ms",
    "bound",
    "speedup",
    "eff",
]


def bound_section(report: dict) -> list[str]:
    """report.md's lines on the bound: per chain draft what it was computed from, then the drafts without one."""
    rows, notes = [], []
    for d in report["drafts"]:
        b = d["bound"]
        if "note" in b:
            notes.append(f"- {d['name']}: {b['note']}")
            continue
        ks = ", ".join(f"{n}: {c}" for n, c in b["chain_lengths"].items())
        cells = [
            d["name"],
            ks,
            cell(b["expected_tokens"], ".2f"),
            cell(d["tau"], ".2f"),
            cell(b["draft_cost"], ".2f"),
        ]
        cells += [
            cell(b["verify_cost"], ".2f"),
            cell(b["plain_step_ms"], ".2f"),
            cell(d["speedup_bound"], ".2f"),
        ]
        rows.append([*cells, cell(d["speedup"], ".2f"), cell(d["efficiency"], ".2f")])
    if not rows and not notes:
        return []
    out = [
        "",
        "Speedup bound, chain drafting: bound = E / (draft cost + verify cost), E = tokens per verify step that "
        "the per-position acceptance gives over the chain lengths drafted (k: steps), costs in decode steps "
        "of the target alone; eff = speedup / bound (below 1: the decoder's time between steps; a low bound: "
        "the draft's acceptance or cost; τ below E: acceptance falls with chain length, which eff carries). "
        'See docs/DECODING.md, "The bound beside the speedup":',
    ]
    if rows:
        out += [
            "",
            "| " + " | ".join(BOUND_HEADER) + " |",
            "|---|---" + "|---:" * (len(BOUND_HEADER) - 2) + "|",
        ]
        out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + ([""] + notes if notes else [])


def format_markdown(report: dict) -> str:
    """report.md: settings, the table, per-position acceptance and the metric definitions."""
    s = report["settings"]
    out = [
        f"# draftsmith eval: {report['target']}",
        "",
        f"- prompts: `{s.get('prompts')}` ({report['baseline']['generations']} generations; "
        f"categories: {', '.join(report['categories'])})",
        f"- k = {s.get('k')}, max new tokens = {s.get('max_new_tokens')}, temperature = {s.get('temperature')}, "
        f"top-k = {s.get('top_k')}, top-p = {s.get('top_p')}, seed = {s.get('seed')}",
        f"- hardware: {report['hardware']}",
    ]
    if report.get("truncated_generations"):
        out.append(
            f"- **{report['truncated_generations']} generation(s) had a prompt longer than the target's context "
            "and kept only its last tokens** (--truncate-prompts)"
        )
    out += [
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---", "---"] + ["---:"] * (len(HEADER) - 2)) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in table_rows(report)]
    if report["drafts"]:
        k = max((len(d["per_position"]) for d in report["drafts"]), default=0)
        out += ["", "Per-position acceptance, P(token i accepted | tokens before it accepted):", ""]
        out += ["| draft | " + " | ".join(str(i + 1) for i in range(k)) + " |", "|---" + "|---:" * k + "|"]
        for d in report["drafts"]:
            cells = [cell(x, ".2f") for x in d["per_position"]] + ["—"] * (k - len(d["per_position"]))
            out.append(f"| {d['name']} | " + " | ".join(cells) + " |")
        chosen = [(d["name"], d["chosen_k"]) for d in report["drafts"] if d.get("chosen_k")]
        if chosen:
            out += [
                "",
                "k (or tree node budget) chosen online (verify steps per choice; 0 = plain decoding):",
                "",
            ]
            out += [f"- {name}: " + ", ".join(f"k={k}: {n}" for k, n in ks.items()) for name, ks in chosen]
    out += bound_section(report)
    for mode in MODES:
        rows = mode.rows(report)
        if rows:
            out += [
                "",
                mode.title,
                "",
                "| " + " | ".join(rows[0]) + " |",
                "|---" + "|---:" * (len(rows[0]) - 1) + "|",
            ]
            out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    if report["drafts"]:
        out += ["", "![per-position acceptance and τ by category](acceptance.png)"]
    out += ["", "```", METRICS, "```", ""]
    return "\n".join(out)


REPORT_FILES = ("report.json", "report.md", PLOT_NAME)
"""What ``write_report`` writes into its folder."""


def write_report(report: dict, out_dir: str | Path) -> list[Path]:
    """Write out_dir/report.json, report.md and the acceptance plot (other files in out_dir are left alone)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out {out} exists and is not a directory; pass a directory for report.json and report.md"
        )
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "report.json", out / "report.md"
    files.write_text(json_path, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    files.write_text(md_path, format_markdown(report))
    if not report["drafts"]:
        return [json_path, md_path]
    from draftsmith.eval.plots import plot_report

    return [json_path, md_path, plot_report(report, out / PLOT_NAME)]
