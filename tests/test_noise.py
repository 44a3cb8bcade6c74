"""bench/noise.py's pure parts: one eval report's figures, and their spread over repeats."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import noise  # noqa: E402


def report(alone: float, draft: float) -> dict:
    return {"baseline": {"tokens_per_s": alone},
            "drafts": [{"name": "ngram", "tokens_per_s": draft, "tau": 1.9, "speedup": draft / alone}]}  # fmt: skip


def test_the_spread_of_each_figure_over_the_repeats():
    summary = noise.summarise([noise.figures(report(20.0, 24.0)), noise.figures(report(22.0, 24.0))])
    alone = summary["target alone"]["tokens_per_s"]
    assert alone["mean"] == pytest.approx(21.0) and alone["range_pct"] == pytest.approx(100 * 2 / 21)
    assert summary["ngram"]["tau"]["sd"] == 0.0  # greedy: τ does not move
    assert summary["ngram"]["speedup"]["values"] == pytest.approx([1.2, 24 / 22])


def test_one_repeat_is_refused(capsys):
    with pytest.raises(SystemExit):
        noise.main(["--repeats", "1", "--draft", "ngram"])
    assert "at least 2" in capsys.readouterr().err
