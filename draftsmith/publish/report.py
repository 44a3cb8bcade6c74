"""Which eval report belongs to a checkpoint, for its model card.

``--report PATH`` when given, else every ``report.json`` under the run directory (and the draft directory)
whose drafts include this checkpoint, newest first. A draft entry matches when its name, resolved against
the directory ``draftsmith eval`` ran in (recovered from the report's ``settings.out``) or the current one,
is the checkpoint's draft directory, or a run directory holding it (``--draft RUN``, as eval reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import draft_dir_of
from draftsmith.files import read_json


@dataclass
class EvalReport:
    path: Path
    report: dict
    entry: dict
    """The report's draft entry for this checkpoint."""


def _eval_cwd(report_file: Path, report: dict) -> Path | None:
    """The directory ``draftsmith eval`` ran in, from where its ``--out`` landed."""
    out = Path(str((report.get("settings") or {}).get("out") or ""))
    folder = report_file.parent.resolve()
    if out.is_absolute():
        return None
    parts = [p for p in out.parts if p not in (".", "")]
    if parts and list(folder.parts[-len(parts) :]) == parts:
        return Path(*folder.parts[: -len(parts)])
    return None


def _matching_entry(report_file: Path, report: dict, draft_dir: Path) -> dict | None:
    want = draft_dir.resolve()
    bases = [b for b in (_eval_cwd(report_file, report), Path.cwd()) if b is not None]
    for entry in report.get("drafts") or []:
        name = Path(str(entry.get("name", "")))
        candidates = [name] if name.is_absolute() else [base / name for base in bases]
        if any(c.exists() and draft_dir_of(c).resolve() == want for c in candidates):  # a run dir: its draft
            return entry
    return None


def find_report(ckpt: DraftCheckpoint, report: str | None = None) -> EvalReport | None:
    """The latest eval report that measured ``ckpt`` (see the module docstring); None if there is none."""
    if report is not None:
        file = Path(report) / "report.json" if Path(report).is_dir() else Path(report)
        if not file.is_file():
            raise FileNotFoundError(
                f"--report {report}: no report.json there (run `draftsmith eval --out DIR` first)"
            )
        data = read_json(file, "Pass the report.json `draftsmith eval --out DIR` wrote")
        entry = _matching_entry(file, data, ckpt.draft_dir)
        if entry is None:
            names = [d.get("name") for d in data.get("drafts") or []]
            raise ValueError(
                f"{file} measured drafts {names}, none of which is {ckpt.draft_dir}; pass the report of an eval "
                f"run with --draft {ckpt.draft_dir}"
            )
        return EvalReport(file, data, entry)
    roots = {ckpt.draft_dir.resolve()}
    roots.add((ckpt.run_dir or ckpt.draft_dir.parent).resolve())
    patterns = ["report.json", "*/report.json", "*/*/report.json", "*/*/*/report.json"]  # bounded depth
    files = {f for root in roots for pattern in patterns for f in root.glob(pattern)}
    for file in sorted(files, key=lambda f: f.stat().st_mtime, reverse=True):
        try:
            data = read_json(file)
        except (OSError, ValueError):  # not a report, or a broken one: only an explicit --report is an error
            continue
        entry = _matching_entry(file, data, ckpt.draft_dir)
        if entry is not None:
            return EvalReport(file, data, entry)
    return None
