"""How long the test suite takes, and where: per tier, per file, the slowest tests.

Runs pytest once with a JUnit report (or reads one a CI run left, ``--junit``), asks pytest which tests each
tier selects (``--collect-only -m``), and sums the recorded times. The tiers are the ones README.md names:

- ``fast``: ``-m "not slow and not engine"`` (tiny random-init models only; the inner loop),
- ``slow``: the real bundled target (``slow``) without an engine,
- ``engine``: a real llama.cpp or vLLM, or a peer pipeline's venv (``engine``).

Prints a table, writes JSON with provenance. A test that skipped counts the seconds it took to skip (its
fixture set-up may be most of them) and is listed as skipped, so a run without the extras shows what it left
out. Setting up the extras (``scripts/install_*.sh``) is not timed here: the CI log has it.

    python bench/suite_durations.py --out bench/results/suite_durations.json
    python bench/suite_durations.py --junit /tmp/ci.xml --out bench/results/suite_durations.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from benchlib.records import provenance, write_json

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"fast": "not slow and not engine", "slow": "slow and not engine", "engine": "engine"}


def collected(marker: str) -> set[str]:
    """Node ids (``tests/x.py::test_y[param]``) pytest selects with ``-m marker``."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marker], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    if done.returncode not in (0, 5):  # 5: nothing selected
        raise SystemExit(f"suite_durations: pytest could not collect -m {marker!r}:\n{done.stdout[-2000:]}")
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def junit_times(path: Path) -> dict[str, dict]:
    """Per node id: seconds and outcome, from a JUnit XML report."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname "tests.test_x" (or "tests.test_x.TestClass"): the file is the part naming a test_ module
        at = max(i for i, part in enumerate(module) if part.startswith("test") or i == 0)
        file = "/".join(module[: at + 1]) + ".py"
        node = "::".join([file, *module[at + 1 :], case.get("name", "")])
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        out[node] = {"seconds": float(case.get("time", 0.0)), "outcome": outcome}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--junit", type=Path, help="a JUnit XML report to read instead of running the suite")
    p.add_argument("--top", type=int, default=15, help="slowest tests to list")
    p.add_argument("--out", type=Path, default=Path("bench/results/suite_durations.json"))
    args = p.parse_args(argv)
    wall = None
    if args.junit is None:
        args.junit = Path(tempfile.mkdtemp()) / "suite.xml"
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={args.junit}"], cwd=ROOT)  # fmt: skip
        wall = time.monotonic() - start
    times = junit_times(args.junit)
    tiers = {}
    for tier, marker in TIERS.items():
        ids = collected(marker)
        ran = [times[i] for i in ids if i in times]
        tiers[tier] = {"marker": marker, "tests": len(ids), "reported": len(ran),
                       "seconds": round(sum(t["seconds"] for t in ran), 1),
                       "skipped": sum(t["outcome"] == "skipped" for t in ran)}  # fmt: skip
    files = defaultdict(float)
    for node, t in times.items():
        files[node.split("::")[0]] += t["seconds"]
    total = sum(t["seconds"] for t in times.values())
    print(
        f"{len(times)} tests, {total / 60:.1f} min of test time"
        + (f", {wall / 60:.1f} min wall" if wall else "")
    )
    print(f"\n{'tier':8s} {'-m':28s} {'tests':>6s} {'skipped':>8s} {'minutes':>8s}")
    for tier, row in tiers.items():
        print(
            f"{tier:8s} {row['marker']:28s} {row['tests']:6d} {row['skipped']:8d} {row['seconds'] / 60:8.1f}"
        )
    print("\nslowest files:")
    for file, seconds in sorted(files.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {seconds / 60:6.1f} min  {file}")
    slowest = sorted(times.items(), key=lambda kv: -kv[1]["seconds"])[: args.top]
    print("\nslowest tests:")
    for node, t in slowest:
        print(f"  {t['seconds']:7.1f} s  {t['outcome']:7s} {node}")
    failed = [n for n, t in times.items() if t["outcome"] in ("failed", "error")]
    result = {"provenance": provenance(), "junit": str(args.junit), "tests": len(times),
              "test_seconds": round(total, 1), "wall_seconds": round(wall, 1) if wall else None, "tiers": tiers,
              "files": {f: round(s, 1) for f, s in sorted(files.items(), key=lambda kv: -kv[1])},
              "slowest": [{"test": n, **t} for n, t in slowest], "failed": failed}  # fmt: skip
    write_json(args.out, result)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
