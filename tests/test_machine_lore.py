"""No machine figures in library text or shipped recipes: how long something took on which machine, and
how fast it ran there, belong in BENCHMARKS.md (with command, machine and date), where they can be kept
true. The library says what a thing does; a recipe may say where its figures are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("draftsmith", "decode", "drafts", "eval", "train", "configs")
FIGURES = [
    re.compile(r"\b(H100|H200|A100|EPYC|Xeon)\b"),  # a machine named where a figure was taken
    re.compile(r"\b\d+(\.\d+)?\s*(minutes?|min|hours?|h|seconds?|s)\s+(of it\s+)?on\s+(one|a|an|\d)", re.I),
    re.compile(r"\bon\s+\d+\s+(CPU\s+)?cores\b", re.I),
    re.compile(r"\b\d[\d,.]*\s*tok/s\b"),
    re.compile(r"\b(several|\d+(\.\d+)?)\s*(times|x|×)\s+(slower|faster)\b", re.I),
]


def library_files() -> list[Path]:
    out = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".yaml") and "data" not in path.relative_to(ROOT).parts[1:2]:
                out.append(path)
    return out


DATASHEET = "# datasheet"
"""Marks a line that quotes a vendor's datasheet (a device's peak FLOP/s), which names a device but states
nothing measured on it."""


def figures_in(text: str) -> list[str]:
    text = "\n".join(line for line in text.splitlines() if not line.rstrip().endswith(DATASHEET))
    return [m.group(0) for pattern in FIGURES for m in pattern.finditer(text)]


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_machine_figures_in_library_text_or_recipes(path):
    found = figures_in(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} states machine figures {found}: put them in BENCHMARKS.md"


def test_the_check_finds_the_figures_it_is_for():
    assert figures_in("about 5 minutes on 2 cores")
    assert figures_in("Measured: 7 minutes of it on one H200")
    assert figures_in("about 6 minutes on 2 CPU cores")
    assert figures_in("made decoding several times slower here")
    assert figures_in("175 tok/s one at a time")
    assert figures_in("about 2x faster drafting")
    assert not figures_in("prefill chunks of 1,024 tokens; BENCHMARKS.md has the timings")
    assert not figures_in('    "H200": 989e12,  # datasheet') and figures_in(
        '    "H200": 989e12,  # measured'
    )
