"""Choosing k online: the k that maximises expected tokens per second, measured while decoding.

The decoder tells the model what every verify step did (``record``): the k it asked for, how many
tokens the drafter proposed, how many the target accepted, and the seconds spent drafting and
verifying. From that it keeps

- per-position acceptance: ``attempted[i]`` / ``accepted[i]`` — steps in which draft position i was
  judged (k > i and positions 0..i-1 accepted; a token the drafter did not propose counts as
  rejected) and steps in which it was accepted. The rate at depth i is shrunk towards the rate at
  depth i-1, or towards ``prior_acceptance`` when that is higher (depth 0: towards ``prior_acceptance``),
  by ``prior_weight`` pseudo-counts, so a depth with little data starts from an optimistic guess and
  gets measured;
- the seconds of a draft call per asked k, and of a verify pass per number of tokens it scores
  (n = 1 is one plain target forward: decoding without speculation), each a slowly forgetting
  mean; draft time is interpolated linearly between measured ks; a one-token pass (plain decoding)
  keeps its own mean, and verify passes of two or more tokens are one straight line fitted over
  every measured width (weighted by samples), which rides out noisy single timings; each k's own
  verify mean is blended with that line (``PRIOR_SAMPLES`` pseudo-samples of the line);
- the mean number of tokens actually proposed per asked k (an n-gram drafter often finds fewer).

Expected tokens per verify step for k: ``E(k) = 1 + sum_{i=1..k} prod_{j<i} a_j`` (``expected_tokens``,
0-based rates); expected seconds:
``D(k) + V(1 + m_k)``; ``k = 0`` is plain decoding (E = 1, seconds = V(1)). ``choose`` returns the
best k, except on exploration steps, which try a neighbour of the best k, plain decoding or a deep
probe at ``start_k``, so that a k once judged bad is measured again; the gap between exploration steps doubles while they do not
change the answer, which bounds what exploring costs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class RunningMean:
    """A mean that forgets slowly: the plain mean of the first 1/decay samples, then exponential."""

    value: float = 0.0
    count: int = 0

    def add(self, x: float, decay: float) -> None:
        self.count += 1
        self.value += max(1.0 / self.count, decay) * (x - self.value)


def interpolate(points: dict[int, RunningMean], x: float, anchor: tuple[float, float] | None = None) -> float:
    """Piecewise-linear through the measured means (plus ``anchor``), linear beyond the ends, slope >= 0.

    With a single point and no anchor the value is flat (the same cost everywhere).
    """
    pts = sorted((float(n), m.value) for n, m in points.items() if m.count)
    if anchor is not None and all(p[0] != anchor[0] for p in pts):
        pts = sorted([*pts, anchor])
    if not pts:
        raise ValueError("no measurements to interpolate")
    if len(pts) == 1:
        return pts[0][1]
    if x <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif x >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(1, len(pts)) if pts[i][0] >= x)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 + slope * (x - x0), 0.0)


def linear_fit(points: dict[int, RunningMean], x: float, max_weight: float) -> float:
    """A straight line (slope >= 0) through the measured means, weighted by their sample counts (at
    most ``max_weight`` each), evaluated at x. Verify time is close to linear in the tokens scored, and
    one fit over every width is far less noisy than a mean per width: a width tried a few times with
    one slow first call no longer looks dear. With two widths it is the line through both."""
    pts = [(float(n), m.value, min(float(m.count), max_weight)) for n, m in points.items() if m.count]
    if not pts:
        raise ValueError("no measurements to fit")
    total = sum(w for _, _, w in pts)
    mean_x = sum(w * n for n, _, w in pts) / total
    mean_y = sum(w * y for _, y, w in pts) / total
    sxx = sum(w * (n - mean_x) ** 2 for n, _, w in pts)
    slope = max(sum(w * (n - mean_x) * (y - mean_y) for n, y, w in pts) / sxx, 0.0) if sxx else 0.0
    return max(mean_y + slope * (x - mean_x), 0.0)


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens committed per verify step with a chain of k drafts, the target's own token included:
    ``1 + sum_{i=1..k} prod_{j<=i} a_j`` with ``a_j = rates[j - 1]`` = P(draft token j accepted | the
    ones before it accepted). Leviathan et al.'s expected tokens with a rate per position (theirs is
    one rate for all); the one definition, for choosing k here and for the eval report's bound."""
    if not 0 <= k <= len(rates):
        raise ValueError(f"a chain of {k} drafts needs 0 <= k <= {len(rates)} (one rate per position)")
    total, survive = 1.0, 1.0
    for rate in rates[:k]:
        survive *= rate
        total += survive
    return total


def best_of(options, rate) -> int:
    """The option with the highest ``rate(option)`` (None = unmeasured); the earlier one on a tie, the
    first option when none is measured."""
    best, best_rate = options[0], -1.0
    for option in options:
        r = rate(option)
        if r is not None and r > best_rate * (1 + 1e-9):
            best, best_rate = option, r
    return best


class Exploration:
    """When an online chooser explores, and what it tries. Exploration steps come every ``interval``
    steps; the interval starts at ``low`` and doubles, up to ``high``, each time exploring finds the
    same best choice, and resets when the best moves, which bounds what exploring costs once the
    estimate settles. Each exploration tries the next of the given probes, in turn."""

    def __init__(self, low: int, high: int, first: int):
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= explore_min <= explore_max, got {low}, {high}")
        self.low, self.high = low, high
        self.interval, self.next_step = low, first
        self.turn = 0
        self.last_best: int | None = None

    def probe(self, step: int, best: int, probes) -> int | None:
        """None when ``step`` is not an exploration step; else the next probe other than ``best``
        (``best`` itself when there is none)."""
        if step < self.next_step:
            return None
        self.interval = min(self.interval * 2, self.high) if best == self.last_best else self.low
        self.last_best = best
        self.next_step = step + self.interval
        candidates = [c for c in dict.fromkeys(probes) if c != best]
        if not candidates:
            return best
        self.turn += 1
        return candidates[(self.turn - 1) % len(candidates)]


PRIOR_SAMPLES = 8.0
"""Pseudo-samples of the width line in a k's verify-cost estimate: its own mean takes over as it is measured."""


class CostModel:
    """Online estimate of tokens/s for each k in 0..k_max, and the k to use next (see the module docstring)."""

    def __init__(
        self,
        k_max: int = 8,
        start_k: int = 4,
        prior_acceptance: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.05,
        explore_min: int = 8,
        explore_max: int = 64,
        thompson: bool = True,
        seed: int = 0,
    ):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance}")
        self.k_max = k_max
        self.prior_acceptance, self.prior_weight, self.decay = prior_acceptance, prior_weight, decay
        self.thompson = thompson
        self._rng = random.Random(seed)
        self.attempted = [0] * k_max
        self.accepted = [0] * k_max
        self.draft_time: dict[int, RunningMean] = {}
        """k asked -> seconds of the draft call."""
        self.verify_time: dict[int, RunningMean] = {}
        """tokens scored by the verify pass (proposed + 1) -> seconds of the pass."""
        self.proposed_len: dict[int, RunningMean] = {}
        """k asked -> tokens the drafter actually proposed."""
        self.verify_by_k: dict[int, RunningMean] = {}
        """k asked -> seconds of the verify pass. A drafter whose proposals vary in length (an n-gram
        draft finds no match, then a long one) mixes cheap one-token passes with dear wide ones; the
        mean of that mixture is not the cost at the mean width, so it is blended in (``step_seconds``)."""
        self.steps = 0
        self.start_k = min(start_k, k_max)
        self._warmup = [0, self.start_k]  # plain cost first, then a first speculative k
        self._explore = Exploration(explore_min, explore_max, first=explore_min)

    # -- what was measured ----------------------------------------------------------------------

    def record(
        self, k: int, proposed: int, accepted: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        """One verify step: asked ``k``, got ``proposed`` draft tokens, the target kept ``accepted``."""
        if not 0 <= accepted <= proposed <= max(k, 0):
            raise ValueError(f"need 0 <= accepted <= proposed <= k, got {accepted}, {proposed}, {k}")
        for i in range(min(k, accepted + 1, self.k_max)):
            self.attempted[i] += 1
        for i in range(min(accepted, self.k_max)):
            self.accepted[i] += 1
        if k > 0:
            self.draft_time.setdefault(k, RunningMean()).add(draft_seconds, self.decay)
            self.proposed_len.setdefault(k, RunningMean()).add(proposed, self.decay)
            self.verify_by_k.setdefault(k, RunningMean()).add(verify_seconds, self.decay)
        self.verify_time.setdefault(proposed + 1, RunningMean()).add(verify_seconds, self.decay)

    # -- the estimates --------------------------------------------------------------------------

    def acceptance_rates(self, sample: bool = False) -> list[float]:
        """``[i]`` = estimated P(draft token i accepted | tokens 0..i-1 accepted), i < k_max.

        ``sample``: for depths >= 1, one draw from the Beta posterior whose mean is the estimate
        (Thompson sampling: a deep position measured a few times is drawn from a wide range, so deeper
        ks get tried). Depth 0 keeps its mean, so a draft rarely accepted at all is not drafted for
        the sake of exploring.
        """
        rates, prior, w = [], self.prior_acceptance, self.prior_weight
        for tried, kept in zip(self.attempted, self.accepted):
            rate = (kept + w * prior) / (tried + w)
            if sample and rates:  # depth 0 stays at its mean: it alone decides whether to draft at all
                a, b = kept + w * prior, tried - kept + w * (1.0 - prior)
                rates.append(self._rng.betavariate(a, b) if a > 0 and b > 0 else rate)
            else:
                rates.append(rate)
            # the next depth shrinks towards this rate but never below prior_acceptance: a depth with
            # little data stays worth measuring (an n-gram draft's later positions are accepted far
            # more often than its first — once a match is right it tends to stay right)
            prior = max(rate, self.prior_acceptance)
        return rates

    def expected_tokens(self, k: int, rates: list[float] | None = None) -> float:
        """Tokens committed per verify step with k drafts (``expected_tokens`` over the estimated rates)."""
        return expected_tokens(self.acceptance_rates() if rates is None else rates, k)

    def draft_seconds(self, k: int) -> float:
        """Seconds of a draft call asking k tokens (0 for k = 0; proportional to k until two ks are measured)."""
        if k == 0 or not self.draft_time:
            return 0.0
        return interpolate(self.draft_time, k, anchor=(0.0, 0.0))

    def verify_seconds(self, n: float) -> float | None:
        """Seconds of a target pass scoring n tokens; None before any pass was measured."""
        if not self.verify_time:
            return None
        # one token is plain decoding, a different path from any verify pass (no mask over new tokens,
        # and on a CPU a 2-token pass can cost far more than one): its mean stands alone when measured
        if n <= 1 and 1 in self.verify_time:
            return self.verify_time[1].value
        wide = {w: m for w, m in self.verify_time.items() if w > 1}
        return linear_fit(wide or self.verify_time, n, 1.0 / self.decay)

    def step_seconds(self, k: int) -> float | None:
        """Expected seconds of one verify step with k asked: draft call + verify pass over the expected proposal."""
        mean_proposed = self.proposed_len[k].value if k in self.proposed_len else float(k)
        verify = self.verify_seconds(1 + (mean_proposed if k else 0.0))
        measured = self.verify_by_k.get(k)
        if k and verify is not None and measured is not None and measured.count:
            # this k's own mean (the real mixture of proposal lengths), shrunk towards the width line:
            # a few noisy timings of one k must not flip the choice between ks that cost alike
            n = min(float(measured.count), 1.0 / self.decay)
            verify = (n * measured.value + PRIOR_SAMPLES * verify) / (n + PRIOR_SAMPLES)
        return None if verify is None else self.draft_seconds(k) + verify

    def tokens_per_second(self, k: int, rates: list[float] | None = None) -> float | None:
        seconds = self.step_seconds(k)
        return None if seconds is None or seconds <= 0 else self.expected_tokens(k, rates) / seconds

    def best_k(self, rates: list[float] | None = None) -> int:
        """The k in 0..k_max with the highest expected tokens/s (the smaller k on a tie); ``rates``
        replaces the estimated acceptance rates (a Thompson draw)."""
        return best_of(range(self.k_max + 1), lambda k: self.tokens_per_second(k, rates))

    # -- the policy -----------------------------------------------------------------------------

    def choose(self) -> int:
        """The k for the next verify step: warm-up (plain, then start_k), then the best k or an exploration."""
        self.steps += 1
        if self._warmup:
            return self._warmup.pop(0)
        best = self.best_k()
        # neighbours, plain decoding, and a deep probe at start_k: from k = 0 its neighbour k = 1 alone
        # cannot show that deeper drafts pay off
        probes = [c for c in (best + 1, best - 1, 0, self.start_k) if 0 <= c <= self.k_max]
        probe = self._explore.probe(self.steps, best, probes)
        if probe is not None:
            return probe
        # Thompson sampling: the best k under one draw of the acceptance rates. It equals the best k
        # once the rates are well measured, and tries deeper ks while deep rates are uncertain.
        return self.best_k(self.acceptance_rates(sample=True)) if self.thompson else best

    def summary(self) -> dict:
        """What the model believes now, for reports: rates, costs and tokens/s per k, and the best k."""
        return {
            "steps": self.steps,
            "best_k": self.best_k(),
            "acceptance_rates": [round(r, 4) for r in self.acceptance_rates()],
            "attempted": list(self.attempted),
            "accepted": list(self.accepted),
            "tokens_per_second": {k: self.tokens_per_second(k) for k in range(self.k_max + 1)},
            "draft_seconds": {k: m.value for k, m in sorted(self.draft_time.items())},
            "verify_seconds": {n: m.value for n, m in sorted(self.verify_time.items())},
        }


class TreeBudget:
    """Online choice of a draft tree's node budget (``TreeSpec.total_tokens``; 0 = plain decoding).

    A tree's acceptance does not factor by position as a chain's does, so this one measures each
    budget directly: per budget, the mean tokens committed per verify step and the mean seconds of a
    step (drafting + verify), each a slowly forgetting mean, and their ratio is its tokens/s. Warm-up
    runs every budget ``warmup_rounds`` times (budgets from the largest down, plain decoding first);
    then ``choose`` returns the best budget, except on exploration steps, which try its neighbours in
    ``budgets`` and plain decoding in turn, with the gap between them doubling while the best does
    not change (as ``CostModel`` does for k).
    """

    def __init__(
        self,
        depth: int,
        top_k: int,
        budgets: tuple[int, ...] = (0, 4, 8, 16, 32, 48, 64),
        decay: float = 0.05,
        warmup_rounds: int = 1,
        explore_min: int = 8,
        explore_max: int = 64,
    ):
        if depth < 1 or top_k < 1:
            raise ValueError(f"tree depth and top_k must be >= 1, got {depth}, {top_k}")
        if not budgets or any(b < 0 for b in budgets):
            raise ValueError(f"tree budgets must be >= 0 (0 = plain decoding), got {budgets}")
        self.depth, self.top_k = depth, top_k
        self.budgets = tuple(sorted(set(budgets)))
        self.decay = decay
        self.tokens: dict[int, RunningMean] = {b: RunningMean() for b in self.budgets}
        self.seconds: dict[int, RunningMean] = {b: RunningMean() for b in self.budgets}
        self.steps = 0
        self._warmup = [
            b for _ in range(warmup_rounds) for b in sorted(self.budgets, key=lambda b: (b != 0, -b))
        ]
        self._explore = Exploration(explore_min, explore_max, first=explore_min + len(self._warmup))

    def record(self, budget: int, committed: int, seconds: float) -> None:
        """One verify step with ``budget`` nodes committed ``committed`` tokens in ``seconds``."""
        if budget not in self.tokens:
            raise ValueError(f"budget {budget} is not one of {self.budgets}")
        self.tokens[budget].add(committed, self.decay)
        self.seconds[budget].add(seconds, self.decay)

    def tokens_per_second(self, budget: int) -> float | None:
        tokens, seconds = self.tokens[budget], self.seconds[budget]
        return tokens.value / seconds.value if tokens.count and seconds.value > 0 else None

    def best_budget(self) -> int:
        """The measured budget with the highest tokens/s (the smaller on a tie; the smallest before any)."""
        return best_of(self.budgets, self.tokens_per_second)

    def choose(self) -> int:
        """The node budget for the next step (0 = a plain decoding step)."""
        self.steps += 1
        if self._warmup:
            return self._warmup.pop(0)
        best = self.best_budget()
        i = self.budgets.index(best)
        probes = [self.budgets[j] for j in (i + 1, i - 1) if 0 <= j < len(self.budgets)] + [0]
        probe = self._explore.probe(self.steps, best, probes)
        return best if probe is None else probe

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "best_budget": self.best_budget(),
            "tokens_per_step": {b: m.value for b, m in self.tokens.items() if m.count},
            "seconds_per_step": {b: m.value for b, m in self.seconds.items() if m.count},
            "tokens_per_second": {b: self.tokens_per_second(b) for b in self.budgets},
        }
