"""A bench result's record: the commit of the code that made it (``code_commit``, ``+dirty`` with a hash of
the difference), the machine, the date and the seed (``provenance``), the settings and hardware around the
figures (``bench_record``), written atomically as JSON (``write_json``)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from draftsmith import files
from draftsmith.eval.report import hardware_description
from draftsmith.loading import cpu_flags, cpu_model

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout ``provenance()`` reads its commit from."""

NOT_CODE = (":(exclude)bench/results", ":(exclude)docs", ":(exclude,glob)**/*.md")
"""What a run may rewrite without changing the code that made its figures: results, docs, Markdown."""


def code_commit(root: Path) -> dict:
    """HEAD's commit at ``root``, ``+dirty`` when the code (anything tracked or untracked-but-not-ignored
    outside ``NOT_CODE``) differs from it, with ``diff_sha256`` (16 hex digits) naming that difference;
    ``{"commit": None, "diff_sha256": None}`` outside a git checkout."""

    def git(*cmd: str) -> bytes:
        try:
            done = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return b""
        return done.stdout if done.returncode == 0 else b""

    commit = git("rev-parse", "HEAD").decode().strip() or None
    if commit is None:
        return {"commit": None, "diff_sha256": None}
    changes = [git("diff", "HEAD", "--binary", "--no-ext-diff", "--", ".", *NOT_CODE)]
    for name in git("ls-files", "--others", "--exclude-standard", "-z", "--", ".", *NOT_CODE).split(b"\0"):
        new_file = root / os.fsdecode(name)
        if name and new_file.is_file():
            changes.append(b"\0new " + name + b"\0" + new_file.read_bytes())
    if not any(changes):
        return {"commit": commit, "diff_sha256": None}
    return {"commit": commit + "+dirty", "diff_sha256": hashlib.sha256(b"".join(changes)).hexdigest()[:16]}


def provenance(seed: int | None = None) -> dict:
    """Where a bench result came from: the command, the git commit of the code it ran from (``+dirty``, with
    ``diff_sha256`` naming the difference, when code, configs, bench scripts or tests differ from it; a
    results file or a doc being rewritten does not count), the CPU's model and its matrix-instruction
    flags, the date, and the seed the run drew its randomness from (``None`` for a run that draws none, such
    as greedy decoding)."""
    flags = sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16", "avx512f", "avx2")))
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), **code_commit(REPO_ROOT),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "flags": flags},
            "date": time.strftime("%Y-%m-%d"), "seed": seed}  # fmt: skip


def bench_record(target, settings: dict, seed: int | None = None, **results) -> dict:
    """A bench script's result: the target's name, the settings it ran with, the hardware, the date and
    ``provenance()``, then ``results``."""
    return {"target": target.name, "settings": settings,
            "hardware": hardware_description(target.device, target.dtype), "date": time.strftime("%Y-%m-%d"),
            "provenance": provenance(seed), **results}  # fmt: skip


def write_json(path: str | Path, result: dict) -> Path:
    """A bench script's result as JSON (undefined rates as null), atomically; says where it went."""
    files.write_text(path, files.json_text(result) + "\n")
    print(f"\nwrote {path}")
    return Path(path)
