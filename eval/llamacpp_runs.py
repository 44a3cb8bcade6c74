"""llama.cpp's own speculative decoding, measured: per-step acceptance read from ``llama-server``'s trace.

``SpeculativeRun`` drives one server setting (``draftsmith.llamacpp.Server`` with
``speculative_args``) over prompts and keeps what it did in eval/stats' record, so the benches
(``bench/llamacpp_engine.py``, ``bench/peer_training.py``) report llama.cpp's τ, α and per-position
acceptance the way ``draftsmith eval`` reports draftsmith's.
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
