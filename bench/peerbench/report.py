"""The peer-training bench's table: each run's exit, steps, rates, peak memory, judged τ and own metrics."""

from __future__ import annotations


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return "[" + " ".join(_short(v) for v in value) + "]"
    return str(value)


def print_table(budget: dict, capture_rec: dict | None, results: dict) -> None:
    print(f"\n{budget['train']['positions']} positions ({budget['train']['loss_tokens']} in the loss), "
          f"{budget['train']['conversations']} conversations; draftsmith steps {budget['draftsmith_steps']}")  # fmt: skip
    if capture_rec:
        print(f"stand-in capture (SpecForge + speculators inputs): {capture_rec['wall_s']:.0f} s wall, "
              f"{capture_rec['tokens_per_s']:.0f} tok/s")  # fmt: skip
    head = f"{'run':<22} {'rc':>3} {'steps':>6} {'wall s':>8} {'CPU s':>8} {'tok/s':>7} {'tok/CPU-s':>9} "
    head += (
        f"{'steady tok/s':>12} {'steady tok/CPU-s':>16} {'peak MB':>8} {'judge τ':>7}  own held-out metrics"
    )
    print(head)
    for run, r in results.items():
        if "skipped" in r:
            print(f"{run:<22} skipped: {r['skipped']}")
            continue

        def num(key, row=r):
            value = row.get(key)
            return format(value, ".0f") if isinstance(value, (int, float)) else "-"

        held = r.get("heldout") or {}
        held_text = " ".join(f"{k}={_short(v)}" for k, v in held.items())
        judged = (r.get("judge") or {}).get("tau")
        judged_text = "-" if judged is None else f"{judged:.3f}"
        print(f"{run:<22} {r['returncode']:>3} {len(r.get('step_marks') or []):>6} {num('wall_s'):>8} "
              f"{num('cpu_s'):>8} {num('tokens_per_wall_s'):>7} {num('tokens_per_cpu_s'):>9} "
              f"{num('steady_tokens_per_wall_s'):>12} {num('steady_tokens_per_cpu_s'):>16} "
              f"{num('peak_rss_mb'):>8} {judged_text:>7}  {held_text}")  # fmt: skip
