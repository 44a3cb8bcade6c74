"""The online cost model that picks k (decode/cost_model.py) and ``generate(k="auto")``."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_target

from draftsmith.decode.cost_model import PRIOR_SAMPLES, CostModel, RunningMean
from draftsmith.decode.speculative import generate, resolve_k
from draftsmith.drafts.base import build_drafter


def test_running_mean_is_a_plain_mean_then_forgets():
    m = RunningMean()
    for x in (1.0, 2.0, 3.0):
        m.add(x, decay=0.5)  # weights 1, 1/2, then max(1/3, 0.5) = 0.5
    assert m.value == pytest.approx(((1.0 + 2.0) / 2 + 3.0) / 2) and m.count == 3


def test_arithmetic_by_hand():
    cm = CostModel(k_max=3, prior_acceptance=0.5, prior_weight=2.0)
    cm.record(k=3, proposed=3, accepted=1, draft_seconds=0.03, verify_seconds=0.04)
    assert cm.attempted == [1, 1, 0] and cm.accepted == [1, 0, 0]
    # depth 0: (1 + 2·0.5) / (1 + 2); depth 1 shrinks to max(depth 0, 0.5): (0 + 2·2/3) / 3;
    # depth 2 untried: max(depth 1, 0.5) = 0.5 — optimistic, so it gets measured
    a0, a1, a2 = 2 / 3, 4 / 9, 0.5
    assert cm.acceptance_rates() == pytest.approx([a0, a1, a2])
    assert cm.expected_tokens(0) == 1.0
    assert cm.expected_tokens(3) == pytest.approx(1 + a0 + a0 * a1 + a0 * a1 * a2)
    assert cm.draft_seconds(0) == 0.0
    assert cm.draft_seconds(3) == pytest.approx(0.03)
    assert cm.draft_seconds(1) == pytest.approx(0.01)  # one measured k: proportional through (0, 0)
    assert cm.verify_seconds(1) == pytest.approx(0.04)  # one measured width: flat
    cm.record(k=0, proposed=0, accepted=0, draft_seconds=0.0, verify_seconds=0.02)
    assert cm.verify_seconds(1) == pytest.approx(0.02)  # plain decoding keeps its own mean
    assert cm.verify_seconds(2) == pytest.approx(0.04)  # one verify width measured (n = 4): flat
    cm.record(k=1, proposed=1, accepted=0, draft_seconds=0.01, verify_seconds=0.034)
    assert cm.verify_seconds(3) == pytest.approx(0.034 + 0.003)  # the line through n = 2 and n = 4
    assert cm.verify_seconds(6) == pytest.approx(0.04 + 2 * 0.003)  # extrapolated
    assert cm.verify_seconds(1) == pytest.approx(0.02)
    assert cm.step_seconds(2) == pytest.approx(
        cm.draft_seconds(2) + cm.verify_seconds(3)
    )  # unmeasured k proposes k
    assert cm.tokens_per_second(0) == pytest.approx(1 / 0.02)
    assert cm.tokens_per_second(3) == pytest.approx(cm.expected_tokens(3) / (0.03 + 0.04))
    rates = {k: cm.tokens_per_second(k) for k in range(4)}
    assert cm.best_k() == max(rates, key=rates.get)


def test_short_proposals_are_rejections_and_cheaper_verifies():
    cm = CostModel(k_max=4, prior_weight=0.0)
    cm.record(k=4, proposed=0, accepted=0, draft_seconds=0.001, verify_seconds=0.02)
    cm.record(k=4, proposed=2, accepted=2, draft_seconds=0.001, verify_seconds=0.03)
    # depth 0 judged twice (once not even proposed), accepted once; depth 2 judged once (not proposed)
    assert cm.attempted == [2, 1, 1, 0] and cm.accepted == [1, 1, 0, 0]
    assert cm.proposed_len[4].value == pytest.approx(1.0)
    # k = 4's own mean (0.025 s over 2 passes) blended with the width line at the mean width 2
    line = cm.verify_seconds(2)
    blended = (2 * 0.025 + PRIOR_SAMPLES * line) / (2 + PRIOR_SAMPLES)
    assert cm.step_seconds(4) == pytest.approx(0.001 + blended)


def feed(cm: CostModel, steps: int, accept, draft_cost: float, verify_base: float = 0.02) -> list[int]:
    """Drive the policy against a simulated drafter/target; returns the ks it chose."""
    chosen = []
    for _ in range(steps):
        k = cm.choose()
        chosen.append(k)
        n = accept(k)
        cm.record(k, k, n, draft_cost * k, verify_base + 0.001 * (k + 1))
    return chosen


def test_picks_plain_decoding_when_drafting_is_costly_and_never_accepted():
    cm = CostModel(k_max=8)
    chosen = feed(cm, 300, accept=lambda k: 0, draft_cost=0.01)
    assert cm.best_k() == 0
    assert chosen[:2] == [0, 4]  # warm-up: plain, then start_k
    late = chosen[100:]
    assert late.count(0) >= 0.97 * len(late)  # exploration gets rarer while it changes nothing
    assert any(k > 0 for k in late)  # ...but never stops


def test_picks_a_large_k_when_drafts_are_cheap_and_accepted():
    cm = CostModel(k_max=8)
    chosen = feed(cm, 200, accept=lambda k: k, draft_cost=0.0002)
    assert cm.best_k() == 8
    assert chosen[-50:].count(8) >= 45


def test_a_k_judged_bad_is_tried_again_when_things_change():
    cm = CostModel(k_max=6)
    feed(cm, 200, accept=lambda k: 0, draft_cost=0.002)
    assert cm.best_k() == 0
    feed(cm, 600, accept=lambda k: k, draft_cost=0.002)  # the drafter turns perfect
    assert cm.best_k() >= 5


def test_resolve_k():
    assert resolve_k(3) == (3, None)
    fixed, model = resolve_k("auto")
    assert fixed == 0 and isinstance(model, CostModel)
    cm = CostModel()
    assert resolve_k(cm)[1] is cm
    for bad in (-1, "fast", 2.5, True):
        with pytest.raises(ValueError, match="k must be"):
            resolve_k(bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", ["ngram", "layers:2"])
def test_auto_k_greedy_output_equals_the_target_alone(arch, spec):
    target = tiny_target(arch)
    prompt = torch.tensor([5, 9, 13, 5, 9, 13, 5, 9, 40, 41])
    reference = generate(target, prompt, None, max_new_tokens=40).tokens
    drafter = build_drafter(spec, target)
    result = generate(target, prompt, drafter, k="auto", max_new_tokens=40)
    assert result.tokens == reference
    assert len(result.chosen_k) == len(result.accepted) == len(result.proposed)
    assert result.chosen_k[:2] == [0, 4]
    assert all(p <= k for p, k in zip(result.proposed, result.chosen_k))
    shared = CostModel(k_max=5)  # one model carried across generations keeps learning
    steps = 0
    for _ in range(2):
        again = generate(target, prompt, drafter, k=shared, max_new_tokens=40)
        assert again.tokens == reference
        steps += len(again.chosen_k)
    assert shared.steps == steps  # both generations fed and asked the same model
    fixed = generate(target, prompt, drafter, k=3, max_new_tokens=40)
    assert fixed.tokens == reference and set(fixed.chosen_k) <= {3, 2, 1, 0}


def test_verify_cost_is_one_line_over_all_widths():
    """A width timed once, slowly, does not make its k look dear: the fit leans on the widths timed often."""
    cm = CostModel(k_max=6)
    for _ in range(20):
        cm.record(k=0, proposed=0, accepted=0, draft_seconds=0.0, verify_seconds=0.05)
        cm.record(k=4, proposed=4, accepted=0, draft_seconds=0.0, verify_seconds=0.07)  # width 5
    cm.record(k=1, proposed=1, accepted=0, draft_seconds=0.0, verify_seconds=0.15)  # width 2, one slow call
    cm.record(k=2, proposed=2, accepted=0, draft_seconds=0.0, verify_seconds=0.065)  # width 3
    for _ in range(19):
        cm.record(k=2, proposed=2, accepted=0, draft_seconds=0.0, verify_seconds=0.065)
    # a mean per width would put width 2 at 0.15; the fit over widths 2, 3 and 5 keeps it near the others
    assert cm.verify_seconds(2) < 0.075
    assert cm.verify_seconds(1) == pytest.approx(0.05)  # plain decoding keeps its own mean
    assert cm.verify_seconds(3) <= cm.verify_seconds(5)


def test_explores_deep_k_from_plain_decoding():
    """Once plain decoding is best, exploration still probes start_k, not only k = 1."""
    cm = CostModel(k_max=8, start_k=4)
    chosen = feed(cm, 300, accept=lambda k: 0, draft_cost=0.01)
    assert 4 in chosen[10:] and 1 in chosen[10:]


def test_varying_proposal_lengths_cost_what_was_measured_for_that_k():
    """An n-gram draft asked for 4 finds no match half the time (a cheap one-token pass) and 4 tokens
    otherwise: the expected cost is the mean of the two, not the cost at the mean width of 3."""
    cm = CostModel(k_max=4)
    for _ in range(10):
        cm.record(k=0, proposed=0, accepted=0, draft_seconds=0.0, verify_seconds=0.05)
        cm.record(k=4, proposed=0, accepted=0, draft_seconds=0.0, verify_seconds=0.05)
        cm.record(k=4, proposed=4, accepted=2, draft_seconds=0.0, verify_seconds=0.09)
    assert cm.step_seconds(4) == pytest.approx(0.07, rel=0.1)
    assert cm.verify_seconds(3) == pytest.approx(0.09)  # the width model alone would say 0.09


def test_thompson_draws_deep_rates_only_and_is_seeded():
    def model(seed):
        cm = CostModel(k_max=4, seed=seed)
        cm.record(k=4, proposed=4, accepted=1, draft_seconds=0.0, verify_seconds=0.03)
        return cm

    means = model(0).acceptance_rates()
    draws = [model(0).acceptance_rates(sample=True) for _ in range(2)]
    assert draws[0] == draws[1]  # same seed, same draws
    assert draws[0][0] == means[0]  # depth 0 decides whether to draft at all: never sampled
    assert draws[0][1:] != means[1:]
    assert model(1).acceptance_rates(sample=True)[1:] != draws[0][1:]


def _simulated_rate(policy, steps: int, seed: int, step) -> float:
    """Tokens/s of a policy (a fixed k or a CostModel) against a simulated drafter and target."""
    import random

    rng, tokens, seconds = random.Random(seed), 0, 0.0
    for _ in range(steps):
        k = policy.choose() if isinstance(policy, CostModel) else policy
        proposed, accepted, draft, verify = step(k, rng)
        if isinstance(policy, CostModel):
            policy.record(k, proposed, accepted, draft, verify)
        tokens, seconds = tokens + accepted + 1, seconds + draft + verify
    return tokens / seconds


def _verify(n: int) -> float:  # a CPU-like verify cost: a step from 1 to 2 tokens, then a gentle slope
    return 0.045 if n <= 1 else 0.053 + 0.0015 * (n - 2)


def _ngram_like(k, rng):
    """No match 70% of the time (an empty proposal); a match's first token is kept 45% of the time,
    later ones 85%: the best k is the largest, and k = 0 looks best to a model that has not seen depth."""
    if k == 0 or rng.random() > 0.3:
        return 0, 0, 0.0002, _verify(1) * rng.uniform(0.95, 1.1)
    accepted = 0
    while accepted < k and rng.random() < (0.45 if accepted == 0 else 0.85):
        accepted += 1
    return k, accepted, 0.0002, _verify(1 + k) * rng.uniform(0.95, 1.1)


def _costly_head(k, rng):
    """A feature-conditioned head: 5 ms per drafted token, first token kept 25% of the time."""
    accepted = 0
    while accepted < k and rng.random() < 0.25:
        accepted += 1
    return k, accepted, 0.0053 * k + (0.003 if k else 0.0), _verify(1 + k) * rng.uniform(0.95, 1.1)


def test_auto_k_against_fixed_k_in_simulation():
    """Issue 7's targets, on simulated timings: within 5% of the best fixed k, never slower than plain."""
    seeds = range(6)

    def mean_rate(policy_for_seed, step):
        return sum(_simulated_rate(policy_for_seed(s), 400, s, step) for s in seeds) / len(seeds)

    best_fixed = max(mean_rate(lambda s, k=k: k, _ngram_like) for k in range(1, 7))
    auto = mean_rate(lambda s: CostModel(k_max=6, seed=s), _ngram_like)
    assert auto >= 0.95 * best_fixed
    plain = mean_rate(lambda s: 0, _costly_head)
    auto = mean_rate(lambda s: CostModel(k_max=6, seed=s), _costly_head)
    assert auto >= 0.97 * plain
