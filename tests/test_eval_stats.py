"""Acceptance statistics and timing totals against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_target

from draftsmith.decode.speculative import GenerationResult, generate
from draftsmith.drafts.model_drafter import ModelDrafter
from draftsmith.drafts.ngram import NgramDrafter
from draftsmith.eval.stats import AcceptanceStats, RunStats, Timing


def test_derivations_by_hand():
    # four verify steps: (proposed, accepted) = (3, 2), (2, 0), (3, 3), (3, 1)
    stats = AcceptanceStats.from_lists(accepted=[2, 0, 3, 1], proposed=[3, 2, 3, 3])
    assert stats.num_steps == 4
    assert stats.accepted_histogram == [1, 1, 1, 1]
    assert stats.tau == pytest.approx((3 + 1 + 4 + 2) / 4)  # mean(accepted + 1)
    assert stats.alpha == pytest.approx(6 / 11)
    # token 0 judged in all 4 steps; token 1 judged where >= 2 proposed and token 0 kept: (3,2), (3,3), (3,1);
    # token 2 judged where token 1 kept: (3,2), (3,3)
    assert stats.proposed_at == [4, 3, 2]
    assert stats.accepted_at == [3, 2, 1]
    assert stats.per_position == pytest.approx([3 / 4, 2 / 3, 1 / 2])


def test_short_proposals_are_not_counted_at_later_positions():
    # a drafter that offers only 1 token which is kept: position 1 was never proposed
    stats = AcceptanceStats.from_lists(accepted=[1, 1, 0], proposed=[1, 2, 0])
    assert stats.proposed_at == [2, 1]
    assert stats.accepted_at == [2, 0]
    assert stats.per_position == [1.0, 0.0]
    assert stats.tau == pytest.approx((2 + 2 + 1) / 3)
    assert stats.alpha == pytest.approx(2 / 3)


def test_baseline_and_empty_records():
    baseline = AcceptanceStats.from_lists([0, 0, 0], [0, 0, 0])
    assert baseline.tau == 1.0
    assert math.isnan(baseline.alpha)
    assert baseline.per_position == []
    empty = AcceptanceStats()
    assert math.isnan(empty.tau) and math.isnan(empty.alpha) and empty.accepted_histogram == []


def test_merging_equals_concatenation_and_does_not_mutate():
    a = AcceptanceStats.from_lists([2, 0], [3, 2])
    b = AcceptanceStats.from_lists([3, 1, 5], [3, 3, 5])
    merged = a + b
    assert merged == AcceptanceStats.from_lists([2, 0, 3, 1, 5], [3, 2, 3, 3, 5])
    assert merged.tau == pytest.approx((3 + 1 + 4 + 2 + 6) / 5)
    assert merged.per_position == pytest.approx([4 / 5, 3 / 4, 2 / 3, 1 / 1, 1 / 1])
    assert a == AcceptanceStats.from_lists([2, 0], [3, 2])  # unchanged
    assert merged.to_dict() == {
        "steps": [[2, 0, 1], [3, 1, 1], [3, 2, 1], [3, 3, 1], [5, 5, 1]],
        "accepted_histogram": [1, 1, 1, 1, 0, 1],
    }


def test_invalid_lists():
    with pytest.raises(ValueError, match="one per step"):
        AcceptanceStats.from_lists([1], [1, 2])
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        AcceptanceStats.from_lists([3], [2])


def test_timing_totals():
    r1 = GenerationResult(tokens=[1, 2, 3], accepted=[1], proposed=[2], target_forwards=2, seconds=0.5)
    r1.draft_seconds, r1.verify_seconds, r1.prefill_seconds = 0.1, 0.2, 0.15
    r2 = GenerationResult(tokens=[4], target_forwards=1, seconds=0.5)
    total = Timing.from_result(r1) + Timing.from_result(r2)
    assert total.generations == 2 and total.new_tokens == 4 and total.target_forwards == 3
    assert total.seconds == pytest.approx(1.0) and total.tokens_per_s == pytest.approx(4.0)
    assert total.draft_seconds == pytest.approx(0.1) and total.verify_seconds == pytest.approx(0.2)
    assert math.isnan(Timing().tokens_per_s)
    run = RunStats.from_result(r1) + RunStats.from_result(r2)
    assert run.acceptance == AcceptanceStats.from_lists([1], [2]) and run.timing == total


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def test_stats_of_real_generations_match_committed_tokens(target):
    prompt = torch.tensor(target.tokenizer("abc abc abc abc")["input_ids"])
    for drafter in (NgramDrafter(), ModelDrafter(target.model, name="self")):
        result = generate(target, prompt, drafter, k=3, max_new_tokens=20)
        assert result.stopped_by == "length"
        stats = AcceptanceStats.from_result(result)
        # every verify forward commits accepted + 1 tokens; the prefill forward commits the first one
        assert stats.num_steps == result.target_forwards - 1
        assert stats.tau * stats.num_steps + 1 == pytest.approx(len(result.tokens))
    # drafting with the target itself: every proposed token is accepted
    assert stats.alpha == 1.0 and all(x == 1.0 for x in stats.per_position)


def test_tau_over_drafting_steps_leaves_out_the_steps_that_proposed_nothing():
    from draftsmith.eval.stats import AcceptanceStats

    # two drafting steps (accept 2 of 3, 0 of 3) and two plain steps (an n-gram without a match)
    stats = AcceptanceStats.from_lists([2, 0, 0, 0], [3, 3, 0, 0])
    assert stats.tau == pytest.approx((2 + 4) / 4)
    assert stats.tau_drafting == pytest.approx((2 + 2) / 2)  # what vLLM's mean acceptance length counts
    assert (
        AcceptanceStats.from_lists([1, 2], [3, 3]).tau_drafting
        == AcceptanceStats.from_lists([1, 2], [3, 3]).tau
    )
