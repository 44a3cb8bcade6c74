"""llama.cpp's own speculative decoding, measured: per-step acceptance read from ``llama-server``'s trace.

``SpeculativeRun`` drives one server setting (``draftsmith.llamacpp.Server`` with
``speculative_args``) over prompts and keeps what it did in eval/stats' record, so the benches
(``bench/llamacpp_engine.py``, ``bench/peer_training.py``) report llama.cpp's τ, α and per-position
acceptance the way ``draftsmith eval`` reports draftsmith's. ``interleaved_runs`` runs several settings
side by side, ``beside_alone`` sums each up against its target alone, and ``print_judged`` sets a head's
llama.cpp numbers beside ``draftsmith eval``'s.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from draftsmith.eval.stats import AcceptanceStats
from draftsmith.llamacpp import Server

ACCEPTED = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")  # llama-server's trace line per verify step


def step_counts(trace: str, new_tokens: int) -> tuple[list[int], list[int]]:
    """(accepted, proposed) per target step of one completion, from the server's trace of it.

    Each "accepted a/p draft tokens" line is one verify step that committed a + 1 tokens; the tokens left
    over (besides the first, which the prompt pass makes) were decoded one at a time, with nothing
    proposed. A last step may commit past ``n_predict`` (the server cuts its output there): then no tokens
    are left over.
    """
    steps = [tuple(map(int, m)) for m in ACCEPTED.findall(trace)]
    plain = new_tokens - 1 - sum(a + 1 for a, _ in steps)
    return [a for a, _ in steps] + [0] * max(plain, 0), [p for _, p in steps] + [0] * max(plain, 0)


@dataclasses.dataclass
class SpeculativeRun:
    """One llama-server setting over a list of prompts: its outputs, per-step acceptance and timing."""

    name: str
    server: Server
    log: Path
    outputs: list[list[int]] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    proposed: list[int] = dataclasses.field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def complete(self, ids: list[int], max_new: int, timed: bool = True) -> None:
        """Greedy completion of ``ids``; counted unless ``timed`` is false (a warm-up)."""
        offset = Path(self.log).stat().st_size
        out = self.server.complete(ids, max_new)
        if not timed:
            return
        trace = Path(self.log).read_bytes()[offset:].decode(errors="replace")
        accepted, proposed = step_counts(trace, len(out["tokens"]))
        self.accepted += accepted
        self.proposed += proposed
        self.outputs.append(out["tokens"])
        self.tokens += len(out["tokens"])
        self.seconds += (out["timings"]["prompt_ms"] + out["timings"]["predicted_ms"]) / 1000

    def summary(self, alone: SpeculativeRun | None = None) -> dict:
        """tokens, seconds, tok/s; beside ``alone`` (the target alone) also τ, α, per-position acceptance,
        speedup and whether the outputs are the target's own."""
        row = {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens / self.seconds}
        if alone is not None and alone is not self:
            stats = AcceptanceStats.from_lists(self.accepted, self.proposed)
            row |= {
                "tau": stats.tau,
                "alpha": stats.alpha,
                "per_position": stats.per_position,
                "speedup": row["tokens_per_s"] / (alone.tokens / alone.seconds),
                "exact_match": self.outputs == alone.outputs,
            }
        return row


def interleaved_runs(settings: dict[str, tuple[Path, list[str]]], prompt_ids: list[list[int]], max_new_tokens: int,
                     folder: Path, threads: int | None = None, progress: bool = False) -> list[SpeculativeRun]:  # fmt: skip
    """Every setting (``TARGET:DRAFT``, ``TARGET:alone`` for the target alone → its target GGUF and
    llama-server flags) in its own server, all up at once (logs in ``folder``): one untimed warm-up each,
    then the prompts interleaved, every setting on a prompt before the next, so load drifts hit all alike."""
    runs: list[SpeculativeRun] = []
    try:
        for name, (model, flags) in settings.items():
            log = folder / f"server-{name.replace(':', '-')}.log"
            server = Server(model, flags, threads, log)
            runs.append(SpeculativeRun(name, server.__enter__(), log))
        for run in runs:  # untimed warm-up
            run.complete(prompt_ids[0], min(32, max_new_tokens), timed=False)
        for i, ids in enumerate(prompt_ids):
            for run in runs:
                run.complete(ids, max_new_tokens)
            if progress:
                print(f"llama.cpp: prompt {i + 1}/{len(prompt_ids)}", flush=True)
    finally:
        for run in runs:
            run.server.__exit__(None, None, None)
    return runs


def beside_alone(runs: list[SpeculativeRun]) -> dict[str, dict]:
    """Each run's ``summary`` beside its target alone (the run named ``TARGET:alone``), grouped by target."""
    targets = dict.fromkeys(r.name.partition(":")[0] for r in runs)
    rows = {}
    for target in targets:
        alone = next(r for r in runs if r.name == f"{target}:alone")
        rows |= {r.name: r.summary(alone) for r in runs if r.name.startswith(f"{target}:")}
    return rows


def print_judged(evals: dict, llama: dict) -> None:
    """Each head as ``draftsmith eval`` (``evals``: k → its report and heads, k = 5 and auto) and llama.cpp
    (``llama``: ``beside_alone``'s rows, Q4_1 and F32 target, k = 5) judged it."""
    heads = {}
    for k, ev in evals.items():
        report = ev.get("report") if isinstance(ev, dict) else None
        for run, head in (ev.get("heads") or {}).items() if report else ():
            row = next((d for d in report["drafts"] if d["name"] == str(head)), None)
            if row:
                heads.setdefault(run, {})[k] = row
    if not heads and not llama:
        return
    print(f"\n{'head':<12} {'τ k5':>5} {'speedup':>7} {'bound':>6} {'τ auto':>6} {'speedup':>7}  "
          f"{'acceptance by position (k5)':<30} {'llama.cpp τ q4_1':>16} {'f32':>5} {'speedup q4_1':>12}")  # fmt: skip
    for run in dict.fromkeys([*heads, *(n.split(":")[1] for n in llama if not n.endswith(":alone"))]):
        five, auto = heads.get(run, {}).get("5", {}), heads.get(run, {}).get("auto", {})
        q4, f32 = llama.get(f"q4_1:{run}", {}), llama.get(f"f32:{run}", {})

        def f(row, key, spec=".2f"):
            return format(row[key], spec) if isinstance(row.get(key), (int, float)) else "-"

        positions = " ".join("-" if a is None else format(a, ".2f") for a in five.get("per_position") or [])
        print(f"{run:<12} {f(five, 'tau'):>5} {f(five, 'speedup'):>7} {f(five, 'speedup_bound'):>6} "
              f"{f(auto, 'tau'):>6} {f(auto, 'speedup'):>7}  {positions:<30} {f(q4, 'tau'):>16} "
              f"{f(f32, 'tau'):>5} {f(q4, 'speedup'):>12}")  # fmt: skip
