"""The train stage (each pipeline in its own venv, one at a time under the bench lock, kept when finished), the
judge stage (each head's τ on the held-out rows) and the tokens/s of a run from its step marks."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path

from .common import BENCH, JUDGE_K, PEER_ROOT, peer_python, pipeline_of, run_seed, run_timed


def train_command(
    run: str, work: Path, budget: dict, overrides: list[str] = (), fresh: bool = False
) -> list[str]:
    """The driver's command for ``run``; ``fresh``: draftsmith's side trains from step 0 even where a checkpoint
    of an earlier training stands in its folder (it resumes from one otherwise)."""
    out = work / "runs" / run
    common = ["--work", str(work), "--out", str(out), "--draft", budget.get("draft", "eagle3")]
    extra = [arg for item in overrides for arg in ("--override", item)]
    pipeline = pipeline_of(run)
    if pipeline == "draftsmith":
        return [
            sys.executable,
            str(BENCH / "peers" / "draftsmith_run.py"),
            *common,
            *extra,
            *(["--fresh"] if fresh else []),
        ]
    return [str(peer_python(pipeline)), str(BENCH / "peers" / f"{pipeline}_run.py"), *common, *extra]


def head_there(record: dict | None) -> bool:
    """Whether the head a run's record names is still there, and is that training's: draftsmith exports its draft
    at every validation, so a training of the same run going on in the same folder (the record's run trained
    again) leaves a head whose ``train_state.json`` says an earlier step than the record's; that is not the
    record's head. A peer's head (no ``train_state.json``) counts when its folder is there."""
    if not record or not record.get("head"):
        return False
    head = Path(record["head"])
    if not head.exists():
        return False
    state = head / "train_state.json"
    if state.exists() and record.get("steps") is not None:
        return json.loads(state.read_text()).get("step") == record["steps"]
    return True


def finished(record: dict | None) -> bool:
    """Whether a run's record is a finished training: it exited 0 and its head is still there (``head_there``)."""
    return bool(record) and record.get("returncode") == 0 and head_there(record)


def judged(record: dict | None) -> bool:
    """Whether a run's record holds its held-out judgement (``judge_heldout``), with or without its head."""
    return bool(record) and record.get("returncode") == 0 and "tau" in (record.get("judge") or {})


def standing(record: dict | None) -> str | None:
    """Why a run's record stands without training it again, or None when it has to train: a finished training,
    or a judged one whose head is gone (a work folder of another machine or session: its figures stand, and
    training it again here would only replace them)."""
    if finished(record):
        return "finished before"
    if judged(record):
        return "judged before; its head is gone, its record stands"
    return None


def stage_train(work: Path, runs: list[str], budget: dict, results: dict | None = None, save=None,
                ablations: dict[str, list[str]] | None = None, rerun: bool | Collection[str] = False,
                judge: bool = False) -> dict:  # fmt: skip
    """Train ``runs`` (and the ``ablations``: run name → overrides, for any pipeline) one at a time into
    ``results``, calling ``save`` after each so a bench cut short keeps the runs that finished. A run whose
    record stands (``standing``) is kept, not trained again (so a sweep stopped half way goes on where it
    stopped, on this machine or another), unless ``rerun`` is True or names it; a run trained again keeps its
    earlier records under ``earlier`` and trains from step 0 (``fresh``) if its head is still there; one stopped
    part way goes on from its last checkpoint, also when it is a judged run trained again for its head. With
    ``judge``, each finished run's head is judged on the held-out rows right after it trains (``judge_heldout``),
    so its judgement is kept even if the head is not."""
    results = {} if results is None else results
    ablations = ablations or {}
    for run in [*runs, *ablations]:
        again = rerun is True or (not isinstance(rerun, bool) and run in rerun)
        if (why := standing(results.get(run))) and not again:
            print(f"peer_training: {run} kept ({why}; --rerun trains it again)", file=sys.stderr)
            continue
        earlier = results.get(run)
        pipeline = pipeline_of(run)
        if pipeline != "draftsmith" and not peer_python(pipeline).exists():
            results[run] = {
                "skipped": f"no venv at {PEER_ROOT / pipeline}: bash scripts/install_peers.sh --train {pipeline}"
            }
            print(f"peer_training: {run} skipped ({results[run]['skipped']})", file=sys.stderr)
            continue
        out = work / "runs" / run
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        print(f"peer_training: training {run} ...", file=sys.stderr, flush=True)
        from benchlib.records import provenance

        overrides = list(ablations.get(run, []))
        made = provenance(seed=run_seed(overrides, pipeline))  # each run's own, taken as it starts
        # a finished run asked to train again starts from step 0; one whose head is gone (judged on another
        # machine or session) trains again here, and goes on from its own checkpoint if a session stopped it
        fresh = finished(earlier)
        timed = run_timed(train_command(run, work, budget, overrides, fresh), out.with_suffix(".log"), env)
        report = out / "result.json"
        timed.update(
            json.loads(report.read_text()) if report.exists() else {"error": "no result.json; see the log"}
        )
        timed.update(throughput(timed, budget))
        timed["overrides"], timed["provenance"] = overrides, made
        if earlier:
            timed["earlier"] = [*earlier.pop("earlier", []), earlier]
        results[run] = timed
        print(f"peer_training: {run} rc={timed['returncode']} in {timed['wall_s']:.0f} s", file=sys.stderr)
        if save:
            save()
        if judge and finished(timed):
            timed["judge"] = judge_heldout(work, run, timed["head"])
            if save:
                save()
    return results


def judge_heldout(work: Path, run: str, head: str) -> dict:
    """The one judge a sweep chooses by: ``bench/heldout_tau.py`` on the quickstart recipe's held-out rows
    (never dev), the teacher computed by the float32 target, k = 5: τ along the greedy decoding walk and
    its per-position acceptance, for any pipeline's head (peer layouts read as ``draftsmith eval`` reads
    them). Each pipeline's own held-out metrics stay in its record beside it."""
    out = work / "judge" / f"{run}.json"
    cmd = [sys.executable, str(BENCH / "heldout_tau.py"), "--recipe", "quickstart", "--draft", str(head),
           "--k", str(JUDGE_K), "--out", str(out)]  # fmt: skip
    timed = run_timed(cmd, out.with_suffix(".log"))
    if timed["returncode"] or not out.exists():
        return {"error": f"heldout_tau.py exited {timed['returncode']}; see {timed['log']}", **timed}
    walk = next(iter(json.loads(out.read_text())["drafts"].values()))
    return {"k": JUDGE_K, "tau": walk["walk"]["tau"], "per_position": walk["walk"]["per_position"],
            "steps": walk["walk"]["steps"], "tau_every_start": walk["every_start"]["tau"],
            "command": cmd, "wall_s": timed["wall_s"]}  # fmt: skip


def judge_missing(work: Path, results: dict, save=None) -> None:
    """Judge every finished run (any draft kind) whose record has no held-out judgement yet (runs kept from before)."""
    for run, record in results.items():
        if finished(record) and "tau" not in (record.get("judge") or {}):
            record["judge"] = judge_heldout(work, run, record["head"])
            if save:
                save()


def throughput(run: dict, budget: dict) -> dict:
    """Tokens/s over the whole run and in steady state (from the end of step 2, or of step 1 when a run
    has fewer than 8 steps, to the end of the last).

    Steady state counts the tokens of those steps where the driver recorded them (``step_tokens``), else
    the mean tokens of a step (all training positions / steps taken), since a peer batches the
    conversations in its own order.
    """
    positions, loss_tokens = budget["train"]["positions"], budget["train"]["loss_tokens"]
    out = {
        "tokens_per_wall_s": positions / run["wall_s"],
        "tokens_per_cpu_s": positions / run["cpu_s"] if run["cpu_s"] else None,
        "loss_tokens_per_wall_s": loss_tokens / run["wall_s"],
    }
    marks = run.get("step_marks") or []  # [(wall, cpu)] at the end of each optimizer step
    skip = 2 if len(marks) >= 8 else 1
    if len(marks) > skip + 1:
        steps = len(marks) - 1 - skip
        counted = run.get("step_tokens") or []
        tokens = sum(counted[skip + 1 :]) if len(counted) == len(marks) else positions / len(marks) * steps
        wall = marks[-1][0] - marks[skip][0]
        cpu = marks[-1][1] - marks[skip][1]
        out["steady_tokens_per_wall_s"] = tokens / wall
        out["steady_tokens_per_cpu_s"] = tokens / cpu if cpu else None
        out["steady_s_per_step"] = wall / steps
    return out
