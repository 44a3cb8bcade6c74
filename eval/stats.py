"""The acceptance statistics and timing totals of speculative generations.

One record of acceptance: for every verify step, how many draft tokens were proposed and how many
of them the target accepted, kept as a histogram over (proposed, accepted) pairs. The histogram of
accepted lengths, the per-position counts, τ, α and the per-position rates all derive from it, so
they can never disagree, and two records merge by adding their counts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from draftsmith.decode.mirror import PARTS, MirrorResult
from draftsmith.decode.speculative import GenerationResult


@dataclass
class AcceptanceStats:
    """``steps[(proposed, accepted)]`` = number of verify steps that proposed that many draft tokens and kept that many."""

    steps: Counter[tuple[int, int]] = field(default_factory=Counter)

    @classmethod
    def from_lists(cls, accepted: Iterable[int], proposed: Iterable[int]) -> AcceptanceStats:
        """From per-step lists (as in ``GenerationResult.accepted`` / ``.proposed``)."""
        accepted, proposed = list(accepted), list(proposed)
        if len(accepted) != len(proposed):
            raise ValueError(
                f"{len(accepted)} accepted counts but {len(proposed)} proposed counts; one per step"
            )
        for a, p in zip(accepted, proposed):
            if not 0 <= a <= p:
                raise ValueError(
                    f"a verify step accepted {a} of {p} proposed draft tokens; need 0 <= accepted <= proposed"
                )
        return cls(Counter(zip(proposed, accepted)))

    @classmethod
    def from_result(cls, result: GenerationResult) -> AcceptanceStats:
        return cls.from_lists(result.accepted, result.proposed)

    def add(self, other: AcceptanceStats) -> AcceptanceStats:
        """A new record holding both records' steps."""
        return AcceptanceStats(self.steps + other.steps)

    __add__ = add

    @property
    def num_steps(self) -> int:
        return sum(self.steps.values())

    @property
    def accepted_histogram(self) -> list[int]:
        """``h[n]`` = verify steps that accepted exactly n draft tokens."""
        hist = [0] * (max((a for _, a in self.steps), default=-1) + 1)
        for (_, a), count in self.steps.items():
            hist[a] += count
        return hist

    @property
    def max_proposed(self) -> int:
        return max((p for p, _ in self.steps), default=0)

    @property
    def proposed_at(self) -> list[int]:
        """``[i]`` = steps in which draft token i was proposed and tokens 0..i-1 were accepted (token i was judged)."""
        counts = [0] * self.max_proposed
        for (p, a), count in self.steps.items():
            for i in range(min(p, a + 1)):
                counts[i] += count
        return counts

    @property
    def accepted_at(self) -> list[int]:
        """``[i]`` = steps in which draft token i was accepted (so were all tokens before it)."""
        counts = [0] * self.max_proposed
        for (_, a), count in self.steps.items():
            for i in range(a):
                counts[i] += count
        return counts

    @property
    def accepted_tokens(self) -> int:
        return sum(a * count for (_, a), count in self.steps.items())

    @property
    def proposed_tokens(self) -> int:
        return sum(p * count for (p, _), count in self.steps.items())

    @property
    def tau(self) -> float:
        """Tokens committed per verify forward, the target's bonus/correction token included: mean(accepted + 1)."""
        steps = self.num_steps
        return (self.accepted_tokens + steps) / steps if steps else math.nan

    @property
    def alpha(self) -> float:
        """Accepted draft tokens / proposed draft tokens (nan when nothing was proposed)."""
        proposed = self.proposed_tokens
        return self.accepted_tokens / proposed if proposed else math.nan

    @property
    def per_position(self) -> list[float]:
        """``[i]`` = P(draft token i accepted | tokens before it accepted) = accepted_at[i] / proposed_at[i]."""
        return [a / p if p else math.nan for a, p in zip(self.accepted_at, self.proposed_at)]

    def to_dict(self) -> dict:
        """JSON-ready: the raw (proposed, accepted, steps) triples and the histogram of accepted lengths."""
        return {
            "steps": [[p, a, n] for (p, a), n in sorted(self.steps.items())],
            "accepted_histogram": self.accepted_histogram,
        }


@dataclass
class Timing:
    """Timing totals over generations (seconds from ``GenerationResult``, prefill included in ``seconds``)."""

    generations: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    target_forwards: int = 0

    @classmethod
    def from_result(cls, result: GenerationResult) -> Timing:
        return cls(
            generations=1,
            new_tokens=len(result.tokens),
            seconds=result.seconds,
            prefill_seconds=result.prefill_seconds,
            draft_seconds=result.draft_seconds,
            verify_seconds=result.verify_seconds,
            target_forwards=result.target_forwards,
        )

    def add(self, other: Timing) -> Timing:
        return Timing(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    __add__ = add

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else math.nan


@dataclass
class MirrorTiming:
    """Mirror decoding's branch reuse and the time of each part of its steps (``decode/mirror.py``),
    summed over generations."""

    steps: int = 0
    hits: int = 0
    """Steps whose proposal was a branch of the previous step's grid."""
    reuse_chances: int = 0
    """Steps that had a previous grid to reuse from."""
    part_seconds: tuple[float, ...] = (0.0,) * len(PARTS)
    """Seconds in each of ``decode.mirror.PARTS``."""
    overlapped_seconds: float = 0.0
    """``MirrorResult.overlapped_seconds``: the modelled two-device time before the channel's."""

    @classmethod
    def from_result(cls, result: MirrorResult) -> MirrorTiming:
        parts = tuple(sum(step[i] for step in result.parts) for i in range(len(PARTS)))
        return cls(len(result.parts), result.hits, result.reuse_chances, parts, result.overlapped_seconds())

    def add(self, other: MirrorTiming) -> MirrorTiming:
        return MirrorTiming(
            self.steps + other.steps,
            self.hits + other.hits,
            self.reuse_chances + other.reuse_chances,
            tuple(a + b for a, b in zip(self.part_seconds, other.part_seconds)),
            self.overlapped_seconds + other.overlapped_seconds,
        )

    __add__ = add

    @property
    def hit_rate(self) -> float:
        return self.hits / self.reuse_chances if self.reuse_chances else math.nan

    def two_device_seconds(self, channel_latency: float) -> float:
        """MODELLED two-device wall time (``MirrorResult.two_device_seconds``), never a measurement."""
        return self.overlapped_seconds + channel_latency * self.steps


@dataclass
class RunStats:
    """Acceptance and timing of one method over some generations; ``mirror`` for mirror decoding."""

    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    timing: Timing = field(default_factory=Timing)
    mirror: MirrorTiming | None = None

    @classmethod
    def from_result(cls, result: GenerationResult) -> RunStats:
        mirror = MirrorTiming.from_result(result) if isinstance(result, MirrorResult) else None
        return cls(AcceptanceStats.from_result(result), Timing.from_result(result), mirror)

    def add(self, other: RunStats) -> RunStats:
        mirror = (
            self.mirror
            if other.mirror is None
            else other.mirror
            if self.mirror is None
            else self.mirror + other.mirror
        )
        return RunStats(self.acceptance + other.acceptance, self.timing + other.timing, mirror)

    __add__ = add
