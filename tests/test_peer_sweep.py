"""bench/peer_sweep.py's pure parts: which setting each pipeline keeps, its seed replicates, the spread over seeds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peer_sweep  # noqa: E402


def run(tau=None, overrides=()):
    return {
        "returncode": 0,
        "overrides": list(overrides),
        **({"judge": {"tau": tau}} if tau is not None else {}),
    }


TRAIN = {
    "specforge": run(1.30),
    "specforge-lr5e4": run(1.45, ["training.learning_rate=5e-4"]),
    "specforge-lr5e4-seed1": run(1.90, ["training.learning_rate=5e-4", "training.seed=1"]),  # not a candidate
    "draftsmith": run(1.60),
    "draftsmith-lr5e4": run(1.50, ["optim.lr=5e-4"]),
    "modelopt": run(None),  # not judged (yet): not a candidate
}


def test_each_pipeline_keeps_its_best_heldout_setting_unless_one_is_named():
    assert peer_sweep.choose(TRAIN) == {"specforge": "specforge-lr5e4", "draftsmith": "draftsmith"}
    named = peer_sweep.choose(TRAIN, ["draftsmith-lr5e4"])
    assert named == {"draftsmith": "draftsmith-lr5e4", "specforge": "specforge-lr5e4"}


def test_the_replicates_are_the_chosen_setting_at_other_seeds_in_each_pipelines_words():
    runs = peer_sweep.seed_runs(TRAIN, {"specforge": "specforge-lr5e4", "draftsmith": "draftsmith"})
    assert runs["specforge-lr5e4-seed2"] == ["training.learning_rate=5e-4", "training.seed=2"]
    assert runs["draftsmith-seed1"] == ["trainer.seed=1"] and runs["draftsmith"] == []
    assert len(runs) == 6


def test_the_summary_is_mean_and_spread_over_the_seeds_of_what_each_judge_gave():
    members = peer_sweep.groups({"draftsmith": "draftsmith"})
    assert members == {"draftsmith": ["draftsmith", "draftsmith-seed1", "draftsmith-seed2"]}
    train = {r: run(t) for r, t in zip(members["draftsmith"], (1.5, 1.6, 1.7))}
    ours = {f"eagle3:{r}": {"tau": t, "speedup": 0.8, "exact_match": True}
            for r, t in zip(members["draftsmith"], (1.2, 1.3, 1.4))}  # fmt: skip
    judged = {
        "engines": {"draftsmith": ours, "vllm": {}},
        "llamacpp": {"rows": {"q4_1:draftsmith": {"tau": 2.0}},
                     "exports": {"draftsmith": {"returncode": 0, "tail": "wrote it"},
                                 "draftsmith-seed1": {"returncode": 2, "tail": "...\nerror: norm_output\n"}}},
    }  # fmt: skip
    row = peer_sweep.summarise(train, members, judged)["draftsmith"]
    assert row["heldout_tau"]["mean"] == pytest.approx(1.6) and row["heldout_tau"]["sd"] == pytest.approx(0.1)
    assert row["dev_tau"]["mean"] == pytest.approx(1.3) and row["dev_speedup"]["sd"] == pytest.approx(0.0)
    assert row["vllm_tau"] is None  # vLLM did not judge: no figure, not a zero
    assert row["llamacpp_tau_q4_1"] == {"mean": 2.0, "sd": None, "n": 1, "values": [2.0]}
    assert row["exact_match"] == [True, True, True]
    # why llama.cpp has no figure for a head it cannot run
    assert row["llamacpp_refused"] == {"draftsmith-seed1": "error: norm_output"}


def test_a_sweep_in_parts_trains_the_named_pipelines_seeds_in_their_order():
    chosen = peer_sweep.choose(TRAIN)
    assert list(peer_sweep.only(chosen, ["draftsmith", "specforge"])) == ["draftsmith", "specforge"]
    assert peer_sweep.only(chosen, []) == chosen
    with pytest.raises(SystemExit, match="modelopt"):  # not judged yet: nothing to replicate
        peer_sweep.only(chosen, ["modelopt"])


def test_the_judge_refuses_missing_heads_unless_partial_and_retrain_names_only_seed_runs(
    tmp_path, monkeypatch
):
    """A record carried from another machine holds judged runs without heads: the judge says which and how to go
    on (--retrain or --partial) instead of judging a subset silently; --retrain takes only the seeds-stage runs."""
    record = tmp_path / "record.json"
    head = tmp_path / "head"
    head.mkdir()
    train = {"draftsmith": {**run(1.6), "head": str(head)}, "draftsmith-seed1": {**run(1.7), "head": "gone"},
             "draftsmith-seed2": {**run(1.65), "head": str(head)}}  # fmt: skip
    record.write_text(json.dumps({"train": train}))
    args = [
        "--record",
        str(record),
        "--work",
        str(tmp_path),
        "--stages",
        "judge",
        "--out",
        str(tmp_path / "o.json"),
    ]
    with pytest.raises(SystemExit, match="no head for draftsmith-seed1.*--retrain RUN.*--partial"):
        peer_sweep.main(args)
    with pytest.raises(SystemExit, match="--retrain draftsmith-lr5e4: not a seeds-stage run"):
        peer_sweep.main([*args, "--retrain", "draftsmith-lr5e4"])
    judged = {}
    monkeypatch.setattr(peer_sweep, "judge", lambda work, heads, *a: judged.update(heads) or {})
    assert peer_sweep.main([*args, "--partial"]) == 0
    assert sorted(judged) == ["draftsmith", "draftsmith-seed2"]
    out = json.loads((tmp_path / "o.json").read_text())
    assert list(out["not_judged"]) == ["draftsmith-seed1"]
    assert out["summary"]["draftsmith"]["heldout_tau"]["n"] == 3  # held-out τ stands for all three


def test_the_judges_provenance_outlives_a_later_stage_writing_the_same_file(tmp_path, monkeypatch):
    """The sweep runs in parts into one --out: a seeds stage after the judge rewrites the file's provenance, so
    the judged figures carry the command and commit of the run that made them."""
    record, head = tmp_path / "record.json", tmp_path / "head"
    head.mkdir()
    train = {
        name: {**run(1.6), "head": str(head)}
        for name in ("draftsmith", "draftsmith-seed1", "draftsmith-seed2")
    }
    record.write_text(json.dumps({"train": train}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "budget.json").write_text("{}")
    monkeypatch.setattr(peer_sweep, "judge", lambda *a: {})
    monkeypatch.setattr(peer_sweep, "stage_train", lambda *a, **k: None)
    common = ["--record", str(record), "--work", str(tmp_path), "--out", str(tmp_path / "o.json")]
    monkeypatch.setattr(sys, "argv", ["peer_sweep.py", "--stages", "judge"])
    peer_sweep.main([*common, "--stages", "judge"])
    monkeypatch.setattr(sys, "argv", ["peer_sweep.py", "--stages", "seeds"])
    peer_sweep.main([*common, "--stages", "seeds"])
    out = json.loads((tmp_path / "o.json").read_text())
    assert "--stages seeds" in out["provenance"]["command"]
    assert "--stages judge" in out["judged"]["provenance"]["command"]
