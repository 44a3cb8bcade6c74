"""The acceptance statistics and timing totals of speculative generations.

One record of acceptance: for every verify step, how many draft tokens were proposed and how many
of them the target accepted, kept as a histogram over (proposed, accepted) pairs. The histogram of
accepted lengths, the per-position counts, τ, α and the per-position rates all derive from it, so
they can never disagree, and two records merge by adding their counts. The speedup bound
(``SpeedupBound``) is derived from it too, with the timing totals.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

from draftsmith.decode.cost_model import expected_tokens
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
    def tau_drafting(self) -> float:
        """τ over the verify steps that had draft tokens only, as vLLM's mean acceptance length counts them
        (its ``spec_decode_num_drafts`` leaves out steps with nothing proposed): equal to τ when every step
        drafted, above it when some had nothing to propose (an n-gram without a match)."""
        drafting = {key: n for key, n in self.steps.items() if key[0] > 0}
        steps = sum(drafting.values())
        return (sum(a * n for (_, a), n in drafting.items()) + steps) / steps if steps else math.nan

    @property
    def alpha(self) -> float:
        """Accepted draft tokens / proposed draft tokens (nan when nothing was proposed)."""
        proposed = self.proposed_tokens
        return self.accepted_tokens / proposed if proposed else math.nan

    @property
    def per_position(self) -> list[float]:
        """``[i]`` = P(draft token i accepted | tokens before it accepted) = accepted_at[i] / proposed_at[i]."""
        return [a / p if p else math.nan for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def chain_lengths(self) -> dict[int, int]:
        """``{n: steps}``: verify steps by the number of draft tokens proposed (0 = a plain decoding step)."""
        counts: Counter[int] = Counter()
        for (p, _), count in self.steps.items():
            counts[p] += count
        return dict(sorted(counts.items()))

    @property
    def expected_tokens(self) -> float:
        """Tokens per verify step that the per-position rates give: the mean over the measured chain
        lengths n of ``decode.cost_model.expected_tokens(per_position, n)``. Equal to τ when every step
        drafted the same n (the product telescopes); apart from it when acceptance depends on the chain
        length, which the rates, pooled over lengths, assume it does not. A position that chains reached
        but none judged (each stopped before it) has no rate and adds nothing."""
        if not self.num_steps:
            return math.nan
        rates = [0.0 if math.isnan(r) else r for r in self.per_position]
        total = sum(expected_tokens(rates, n) * count for n, count in self.chain_lengths.items())
        return total / self.num_steps

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


class ModeStats(Protocol):
    """What a decoding mode measures beyond acceptance and timing, summed over generations like them, and
    what the report shows of it (mirror decoding: ``eval/mirror_stats.py``; ``eval/report.py`` lists them)."""

    key: ClassVar[str]
    """The mode's name (``Method.decoding``) and its entry's key in a draft's report.json entry."""
    no_bound: ClassVar[str]
    """Why the report gives the mode no speedup bound."""
    title: ClassVar[str]
    """The title of the mode's table."""
    metrics: ClassVar[str]
    """The mode's lines of the metric definitions."""

    def __add__(self, other: Any) -> Any: ...

    def entry(self, timing: Timing, baseline: Timing, settings: dict) -> dict:
        """The draft's entry under ``key``, from its timing, the target alone's and the eval's settings."""

    @staticmethod
    def rows(report: dict) -> list[list[str]]:
        """The mode's table over a report: a header and a row per draft of the mode; empty for none."""


@dataclass
class RunStats:
    """Acceptance and timing of one method over some generations, and its decoding mode's own statistics."""

    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    timing: Timing = field(default_factory=Timing)
    mode: ModeStats | None = None
    """What the method's decoding mode measures beyond these (None for chains and trees)."""

    @classmethod
    def from_result(cls, result: GenerationResult, mode: ModeStats | None = None) -> RunStats:
        return cls(AcceptanceStats.from_result(result), Timing.from_result(result), mode)

    def add(self, other: RunStats) -> RunStats:
        mode = (
            self.mode if other.mode is None else other.mode if self.mode is None else self.mode + other.mode
        )
        return RunStats(self.acceptance + other.acceptance, self.timing + other.timing, mode)

    __add__ = add


@dataclass(frozen=True)
class SpeedupBound:
    """The speedup a chain draft's measured acceptance and costs allow, to set beside the measured one.

    bound = E / (draft_cost + verify_cost). E: tokens per verify step from the per-position rates,
    E(n) = 1 + sum_{i=1..n} prod_{j<=i} a_j averaged over the chain lengths n the steps drafted. Costs:
    the mean seconds of a step's draft call and of its verify pass, over a plain step (the target
    alone's decode seconds per step, prefill excluded). Tokens/s over a run is total tokens over total
    seconds, so with k varying per step (--k auto) the bound takes the measured distribution of k as it
    ran (mean E over mean cost), and does not judge the choice of k.

    It is what the draft would reach if its loop spent nothing outside drafting and verifying:
    ``efficiency`` (measured / bound) below 1 is the decoder's shortfall (time between steps, prefill),
    a low bound the draft's. Prefill pulls a short run towards 1, so a bound below 1 can be beaten.
    Chains only: trees and other decoding modes follow other formulas.
    """

    expected_tokens: float
    draft_cost: float
    """Seconds of a step's draft call / seconds of a plain step (the window also holds choosing k, --k auto)."""
    verify_cost: float
    """Seconds of a step's verify pass (forward over the last token + drafts, accept, roll back) / a plain step."""
    plain_step_seconds: float
    """The target alone's decode seconds per step: the unit of both costs."""
    chain_lengths: dict[int, int]
    """Verify steps per chain length (``AcceptanceStats.chain_lengths``)."""
    proposed_tokens: int

    @classmethod
    def measure(cls, draft: RunStats, baseline: RunStats) -> SpeedupBound | None:
        """From a chain draft's stats and the target alone's over the same prompts; None when either ran
        no decode step or a step took no time."""
        steps, base_steps = draft.acceptance.num_steps, baseline.acceptance.num_steps
        if not steps or not base_steps:
            return None
        plain = (baseline.timing.seconds - baseline.timing.prefill_seconds) / base_steps
        draft_cost = draft.timing.draft_seconds / steps / plain if plain > 0 else 0.0
        verify_cost = draft.timing.verify_seconds / steps / plain if plain > 0 else 0.0
        if draft_cost + verify_cost <= 0:
            return None
        acc = draft.acceptance
        return cls(
            acc.expected_tokens, draft_cost, verify_cost, plain, acc.chain_lengths, acc.proposed_tokens
        )

    @property
    def speedup(self) -> float:
        """Expected tokens per step / expected cost of a step, in plain target steps."""
        return self.expected_tokens / (self.draft_cost + self.verify_cost)

    @property
    def mean_chain_length(self) -> float:
        return self.proposed_tokens / sum(self.chain_lengths.values())

    @property
    def draft_cost_per_token(self) -> float:
        """Leviathan et al.'s c: seconds per drafted token / a plain step (nan when nothing was drafted)."""
        steps = sum(self.chain_lengths.values())
        return self.draft_cost * steps / self.proposed_tokens if self.proposed_tokens else math.nan

    def efficiency(self, measured_speedup: float) -> float:
        """Measured speedup / the bound: the share of what acceptance and costs allow that the run delivered."""
        return measured_speedup / self.speedup
