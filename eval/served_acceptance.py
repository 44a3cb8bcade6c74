"""Acceptance where a draft is served: a running vLLM server's own speculative-decoding counters.

A head can be accepted well in draftsmith's decoder and badly once served (another layer-id convention,
a norm the engine applies twice, a draft vocabulary mapped wrongly). ``judge_server`` measures it where it
is served: it reads the server's ``/metrics`` counters, sends the prompts (rendered by draftsmith with
the target's chat template, as token ids; a later turn continues after the server's own answer, as
``draftsmith eval`` continues after each method's), reads the counters again, and turns the difference
into eval/stats' one record of acceptance, so τ, α and per-position acceptance mean what they mean in
``draftsmith eval``.

vLLM counts, per verify step that had draft tokens, how many of them it accepted
(``vllm:spec_decode_num_drafts``, ``..._num_accepted_tokens_per_pos``): when every step drafted the
same k tokens, as EAGLE and Medusa steps do, that is the histogram of accepted lengths exactly. A
proposer whose drafts vary in length (n-gram) gives τ and α exactly and per-position rates over the
steps that drafted, marked as such.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from draftsmith.eval.prompts import EvalPrompt, answer_text, render
from draftsmith.eval.stats import AcceptanceStats
from draftsmith.openai_client import CompletionServer, ServerError
from draftsmith.vllm import SpecCounters, parse_spec_counters

COUNTER = "vllm:spec_decode_num_"
"""The prefix of vLLM's speculative-decoding counters, each named as the ``SpecCounters`` field that sums it."""


def check_counters(before: SpecCounters, after: SpecCounters, url: str, new_tokens: int) -> SpecCounters:
    """What the server's counters say happened between two readings, after checking it can have happened:
    no counter went down, something was drafted, acceptance is at most 1, τ at most k + 1, and the
    per-position counts add up to the accepted total, each at most the one before. Otherwise one
    ``ServerError`` naming the counter and the server, since a report of them would be silently wrong."""
    moved = after - before
    fix = (
        "its counters are not reported. Run the eval again with no other traffic on the server and no restart "
        "meanwhile, on a vLLM whose counters draftsmith reads (docs/EXPORT.md, 'Judging a served head')"
    )

    def contradiction(what: str) -> ServerError:
        return ServerError(
            f"{url}'s speculative-decoding counters contradict each other over this run: {what}; {fix}"
        )

    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        if getattr(moved, name) < 0:
            raise contradiction(
                f"{COUNTER}{name} went down, from {getattr(before, name):,} to {getattr(after, name):,}"
            )
    if any(n < 0 for n in moved.accepted_per_position):
        raise contradiction(f"{COUNTER}accepted_tokens_per_pos went down, from {before.accepted_per_position} to "
                            f"{after.accepted_per_position}")  # fmt: skip
    if not (moved.drafts or moved.draft_tokens or moved.accepted_tokens or any(moved.accepted_per_position)):
        raise ServerError(
            f"{url} drafted nothing for these prompts: its {COUNTER}drafts and the other speculative-decoding "
            f"counters did not move while it generated {new_tokens:,} tokens, so there is no acceptance to report. "
            "Check that it serves the draft for every request (a --speculative-config with disable_by_batch_size "
            "or a draft of another target drafts nothing), and that --max-new-tokens leaves steps to draft in"
        )
    if not moved.drafts:
        raise contradiction(f"{COUNTER}drafts did not move, yet {COUNTER}draft_tokens moved by {moved.draft_tokens:,} "
                            f"and {COUNTER}accepted_tokens by {moved.accepted_tokens:,}")  # fmt: skip
    if moved.accepted_tokens > moved.draft_tokens:
        raise contradiction(
            f"{COUNTER}accepted_tokens moved by {moved.accepted_tokens:,}, more than the {moved.draft_tokens:,} of "
            f"{COUNTER}draft_tokens (an acceptance of {moved.accepted_tokens / max(moved.draft_tokens, 1):.2f} > 1)"
        )
    k = len(moved.accepted_per_position)
    if k and moved.accepted_tokens > k * moved.drafts:
        raise contradiction(
            f"{COUNTER}accepted_tokens moved by {moved.accepted_tokens:,} over {moved.drafts:,} {COUNTER}drafts, a τ "
            f"of {1 + moved.accepted_tokens / moved.drafts:.3f} > k + 1 = {k + 1} ({k} positions counted)"
        )
    if k and sum(moved.accepted_per_position) != moved.accepted_tokens:
        raise contradiction(
            f"{COUNTER}accepted_tokens_per_pos moved by {moved.accepted_per_position}, which add up to "
            f"{sum(moved.accepted_per_position):,}, not the {moved.accepted_tokens:,} of {COUNTER}accepted_tokens"
        )
    reached = [moved.drafts, *moved.accepted_per_position]
    if any(a < b for a, b in zip(reached, reached[1:])):
        raise contradiction(
            f"{COUNTER}accepted_tokens_per_pos moved by {moved.accepted_per_position} over {moved.drafts:,} "
            f"{COUNTER}drafts: a position accepted more often than the one before it (or than there were drafts)"
        )
    return moved


def acceptance_from_counters(counters: SpecCounters) -> tuple[AcceptanceStats, bool]:
    """(the record of acceptance, whether it is exact). Exact when every counted step drafted
    ``k = len(accepted_per_position)`` tokens; otherwise steps are taken to have drafted k (τ and α are
    then still exact from the totals, which the caller reports from ``counters``)."""
    per_pos, steps = counters.accepted_per_position, counters.drafts
    k = len(per_pos)
    if any(a < b for a, b in zip(per_pos, per_pos[1:])) or (per_pos and per_pos[0] > steps):
        raise ServerError(f"the server's per-position acceptance counts are not decreasing: {per_pos}")
    reached = [steps, *per_pos, 0]  # steps whose first i draft tokens were all accepted
    histogram = Counter(
        {(k, a): reached[a] - reached[a + 1] for a in range(k + 1) if reached[a] > reached[a + 1]}
    )
    return AcceptanceStats(histogram), counters.draft_tokens == k * steps


@dataclass
class ServedRun:
    """What one pass of the prompts through a served draft did."""

    counters: SpecCounters
    outputs: list[list[list[int]]] = field(default_factory=list)
    """``outputs[prompt][turn]``: the server's greedy token ids"""
    seconds: float = 0.0
    in_flight: int = 1

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for turns in self.outputs for t in turns)

    def summary(self) -> dict:
        """τ (vLLM's mean acceptance length), α, per-position acceptance and tok/s, JSON-ready."""
        row = {"tokens": self.new_tokens, "seconds": self.seconds, "in_flight": self.in_flight,
               "tokens_per_s": self.new_tokens / self.seconds if self.seconds else math.nan}  # fmt: skip
        c = self.counters
        if not c.drafts:
            return row | {"verify_steps_with_drafts": 0}
        stats, exact = acceptance_from_counters(c)
        return row | {
            "tau": 1 + c.accepted_tokens / c.drafts,
            "alpha": c.accepted_tokens / c.draft_tokens if c.draft_tokens else math.nan,
            "per_position": stats.per_position,
            "per_position_exact": exact,
            "verify_steps_with_drafts": c.drafts,
            "draft_tokens": c.draft_tokens,
            "accepted_tokens": c.accepted_tokens,
            "accepted_per_position": c.accepted_per_position,
        }


def read_counters(server: CompletionServer, url_hint: str = "") -> SpecCounters:
    """The server's counters now; a server with none serves no draft, which is said, not read as zero."""
    counters = parse_spec_counters(server.metrics())
    if not counters.served:
        raise ServerError(
            f"{server.url} serves no draft: its /metrics has no vllm:spec_decode counters. Start it with a draft "
            '(vllm serve TARGET --speculative-config \'{"method": "eagle3", "model": DIR, '
            '"num_speculative_tokens": 5}\')' + url_hint
        )
    return counters


def judge_server(server: CompletionServer, tokenizer, prompts: list[EvalPrompt], max_new_tokens: int,
                 in_flight: int = 1, progress=None, counted: bool = True) -> ServedRun:  # fmt: skip
    """Every turn of every prompt, greedy, through ``server`` with ``in_flight`` requests at once;
    the counters' difference over the pass, checked (``check_counters``; ``counted=False``: a server without
    a draft, timed only).

    The server must have no other traffic meanwhile: its counters are the server's, not this client's.
    """
    before = read_counters(server) if counted else SpecCounters(served=False)
    outputs: list[list[list[int]] | None] = [None] * len(prompts)
    lock, queue, failures = threading.Lock(), list(range(len(prompts)))[::-1], []

    def conversation(p: EvalPrompt) -> list[list[int]]:
        messages, answers = [], []
        for turn in p.turns:
            messages.append({"role": "user", "content": turn})
            ids = server.greedy_ids(render(tokenizer, messages).tolist(), max_new_tokens)
            answers.append(ids)
            messages.append({"role": "assistant", "content": answer_text(tokenizer, ids)})
        return answers

    def worker() -> None:
        while True:
            with lock:
                if not queue or failures:
                    return
                i = queue.pop()
            try:
                outputs[i] = conversation(prompts[i])
            except Exception as err:  # noqa: BLE001 (re-raised in the caller's thread)
                failures.append(err)
                return
            if progress is not None:
                progress(sum(o is not None for o in outputs), len(prompts))

    start = time.perf_counter()
    threads = [
        threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(in_flight, len(prompts))))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if failures:
        raise failures[0]
    answers = [o or [] for o in outputs]
    if not counted:
        return ServedRun(SpecCounters(served=False), answers, seconds, in_flight)
    moved = check_counters(before, read_counters(server), server.url, sum(len(t) for a in answers for t in a))
    return ServedRun(moved, answers, seconds, in_flight)


def served_table(record: dict, k: int | str | None = None) -> str:
    """The served draft's acceptance, and each draftsmith draft's beside it (``record`` as in served.json)."""
    served = record["served"]
    rates = lambda row: " ".join(  # noqa: E731
        "-" if r is None or r != r else f"{r:.2f}" for r in row.get("per_position") or []
    )
    num = lambda row, key, spec: "-" if row.get(key) is None else format(row[key], spec)  # noqa: E731
    lines = [f"{'method':<28} {'τ':>6} {'α':>6} {'tok/s':>7}  acceptance by position",
             f"{'served: ' + record['server']:<28} {num(served, 'tau', '.3f'):>6} {num(served, 'alpha', '.3f'):>6} "
             f"{num(served, 'tokens_per_s', '.1f'):>7}  {rates(served)}"]  # fmt: skip
    for name, row in (record.get("draftsmith") or {}).items():  # τ over drafting steps, as vLLM counts
        lines.append(f"{'draftsmith: ' + name:<28} {num(row, 'tau_drafting', '.3f'):>6} {num(row, 'alpha', '.3f'):>6} "
                     f"{num(row, 'tokens_per_s', '.1f'):>7}  {rates(row)}")  # fmt: skip
    served_k = len(served.get("accepted_per_position") or [])
    if record.get("draftsmith") and isinstance(k, int) and served_k and served_k != k:
        lines.append(
            f"note: the server drafts {served_k} tokens a step and draftsmith --k {k}: not like for like"
        )
    if record.get("draftsmith"):
        lines.append("τ: tokens per verify step that had draft tokens (vLLM's mean acceptance length; draftsmith's "
                     "tau_drafting)")  # fmt: skip
    if served.get("per_position_exact") is False:
        lines.append(
            "note: the server's drafts varied in length, so its rates by position count every step as full"
        )
    return "\n".join(lines)
