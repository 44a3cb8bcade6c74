"""The eval report's picture: per-position acceptance and τ per category, one PNG."""

from __future__ import annotations

from pathlib import Path

from draftsmith import files

PLOT_NAME = "acceptance.png"


def plot_report(report: dict, path: str | Path) -> Path:
    """Draw report.json's drafts: P(token i accepted | before accepted) by position, and τ by category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = report["drafts"]
    categories = sorted({c for d in drafts for c in d["categories"]})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for d in drafts:
        points = [(i + 1, p) for i, p in enumerate(d["per_position"]) if p is not None]
        if points:
            left.plot(*zip(*points), marker="o", label=d["name"])
    k = max((len(d["per_position"]) for d in drafts), default=1)
    left.set_xticks(range(1, k + 1))
    left.set(xlabel="draft position i", ylabel="P(accepted | earlier accepted)", ylim=(0, 1.05))
    left.set_title("per-position acceptance")
    left.legend(fontsize=8)
    width = 0.8 / max(len(drafts), 1)
    for n, d in enumerate(drafts):
        taus = [d["categories"].get(c, {}).get("tau") or 0.0 for c in categories]
        left_edge = [i + n * width - 0.4 + width / 2 for i in range(len(categories))]
        right.bar(left_edge, taus, width=width, label=d["name"])
    right.axhline(1.0, color="gray", linewidth=0.8)  # the target alone
    right.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=8)
    right.set(ylabel="τ (tokens per target forward)")
    right.set_title("τ by category")
    fig.suptitle(f"{report['target']} — k = {report['settings'].get('k')}", fontsize=10)
    fig.tight_layout()
    try:
        files.write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return path
