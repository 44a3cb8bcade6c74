"""The benchmarks' timed runs (bench/benchlib/timed.py, bench/benchlib/train_speed.py): what they did is eval/stats'
record of the generations they ran, and the JSON rows the bench scripts write derive from it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from benchlib import timed
from benchlib.train_speed import StepTimer, peak_flops
from tiny import tiny_target

from draftsmith.decode.speculative import generate
from draftsmith.drafts import build_drafter
from draftsmith.eval.harness import balanced_order
from draftsmith.eval.stats import AcceptanceStats

MAX_NEW = 24


def prompts() -> list[torch.Tensor]:
    """Repetitive ones give the n-gram drafter accepted runs, a random one none."""
    return [
        torch.tensor([7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]),
        torch.tensor([50, 60, 50, 60, 50, 60, 50]),
        torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)),
    ]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def test_decode_each_keeps_the_record_of_every_generation(target):
    ngram = build_drafter("ngram", target)
    run = timed.decode_each(target, prompts(), ngram, 4, MAX_NEW)
    alone = [generate(target, p, ngram, k=4, max_new_tokens=MAX_NEW) for p in prompts()]
    assert run.outputs == [r.tokens for r in alone]
    assert run.stats.acceptance == sum((AcceptanceStats.from_result(r) for r in alone), AcceptanceStats())
    assert run.stats.acceptance.accepted_tokens > 0  # the record holds real drafting, not empty steps
    timing = run.stats.timing
    assert timing.generations == 3 and timing.new_tokens == sum(map(len, run.outputs)) and timing.seconds > 0


def test_decode_batched_equals_one_at_a_time_and_counts_batched_passes(target):
    ngram = build_drafter("ngram", target)
    each = timed.decode_each(target, prompts(), ngram, 4, MAX_NEW)
    batched = timed.decode_batched(target, prompts(), ngram, 4, 2, MAX_NEW)  # a batch of 2, then of 1
    assert batched.outputs == each.outputs
    # n-gram proposals depend on the tokens alone: the very same steps, so the very same record
    assert batched.stats.acceptance == each.stats.acceptance
    assert batched.stats.timing.generations == 3
    assert batched.stats.timing.new_tokens == each.stats.timing.new_tokens
    assert batched.stats.timing.target_forwards < each.stats.timing.target_forwards  # passes shared by rows


def test_batched_row_derives_tau_and_exact_from_the_record(target):
    ngram = build_drafter("ngram", target)
    reference = timed.decode_each(target, prompts(), None, 0, MAX_NEW).outputs
    row = timed.batched_row(target, prompts(), reference, ngram, 4, 3, MAX_NEW)
    run = timed.decode_batched(target, prompts(), ngram, 4, 3, MAX_NEW)
    assert row["tau"] == run.stats.acceptance.tau > 1.0
    assert row["exact"] == row["prompts"] == 3 and row["tokens"] == sum(map(len, reference))
    assert row["batched_forwards"] == run.stats.timing.target_forwards
    wrong = [[t + 1 for t in out] for out in reference[:2]] + reference[2:]
    assert timed.batched_row(target, prompts(), wrong, None, 0, 3, MAX_NEW)["exact"] == 1
    assert (
        timed.batched_row(target, prompts(), reference, None, 0, 3, MAX_NEW)["tau"] == 1.0
    )  # the target alone


def test_side_by_side_times_every_decoder_on_every_prompt(target):
    ngram = build_drafter("ngram", target)
    decoders = {
        "draftsmith alone": timed.draftsmith_decoder(target, None, 0),
        "transformers generate": timed.transformers_decoder(target),
        "draftsmith ngram": timed.draftsmith_decoder(target, ngram, 4),
        "wrong": lambda prompt, max_new: [0] * max_new,
    }
    rows = timed.side_by_side(decoders, prompts()[0], prompts(), MAX_NEW)
    assert list(rows) == list(decoders)
    for name, row in rows.items():
        assert len(row["outputs"]) == 3 and row["tokens"] == sum(map(len, row["outputs"])), name
        assert row["seconds"] > 0 and row["tokens_per_s"] == row["tokens"] / row["seconds"], name
    # greedy in float32: transformers' generate and draftsmith's loop, with or without drafts, agree
    assert [rows[n]["same_as_first"] for n in decoders] == [3, 3, 3, 0]


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_the_balanced_order_puts_each_decoder_in_every_place_and_after_every_other(n):
    """Over n prompts (2n for odd n): each decoder in every place, and right after every other decoder
    equally often. A plain rotation (which kept the decoder after vLLM's server 24 % slower on the EPYC
    than the same code elsewhere in the order) fails the second."""
    prompts = n if n % 2 == 0 else 2 * n
    orders = [balanced_order(n, i) for i in range(prompts)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert all({order[p] for order in orders} == set(range(n)) for p in range(n))
    pairs = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(pairs.values())) == 1
    rotation = [[(j + i) % n for j in range(n)] for i in range(prompts)]
    if n > 2:
        assert len({(a, b) for order in rotation for a, b in zip(order, order[1:])}) < n * (n - 1)


def test_side_by_side_rotates_which_decoder_runs_first():
    """No decoder always runs right after the same one: over as many prompts as decoders, each runs in
    every place once (a fixed order measured identical code 26 % apart on a CPU)."""
    calls = []

    def decoder(name):
        def run(prompt, max_new):
            calls.append(name)
            return [1] * max_new

        return run

    names = ["a", "b", "c"]
    many = [torch.tensor([i]) for i in range(6)]
    timed.side_by_side({n: decoder(n) for n in names}, many[0], many, 2)
    timed_calls = calls[len(names) :]  # after one warm-up each
    places = {n: {timed_calls[i * 3 : i * 3 + 3].index(n) for i in range(6)} for n in names}
    assert places == {n: {0, 1, 2} for n in names}, timed_calls


def test_step_timer_mfu_is_flops_per_token_times_tokens_per_second_over_peak():
    timer = StepTimer()
    assert timer.mfu(1e12) is None  # nothing timed yet
    timer.flops_per_token, timer.tokens, timer.seconds = 2e9, 1000, 4.0
    assert timer.mfu(1e12) == pytest.approx(2e9 * 1000 / 4.0 / 1e12)
    assert peak_flops(torch.device("cpu")) is None and timer.mfu() is None  # no peak known on the CPU


def test_evaluate_runs_its_methods_in_the_balanced_order(monkeypatch):
    """draftsmith eval's interleaving: the target alone is not always first, nor always right after the same
    method (a fixed order measured identical code apart by its place alone)."""
    from tiny import tiny_target

    from draftsmith.drafts.ngram import NgramDrafter
    from draftsmith.eval import harness
    from draftsmith.eval.prompts import EvalPrompt

    ran = []
    real = harness.run_prompt

    def recording(target, method, prompt, *args, **kwargs):
        ran.append(method.name)
        return real(target, method, prompt, *args, **kwargs)

    monkeypatch.setattr(harness, "run_prompt", recording)
    prompts = [EvalPrompt(f"p{i}", "code", (f"abc {i} abc {i}",)) for i in range(4)]
    names = ["ngram-a", "ngram-b", "ngram-c"]
    harness.evaluate(tiny_target("llama"), [(n, NgramDrafter()) for n in names], prompts, max_new_tokens=3,
                     warmup=0, progress=False)  # fmt: skip
    orders = [ran[i * 4 : i * 4 + 4] for i in range(4)]
    assert {order[0] for order in orders} == set(orders[0])  # each method first once
    after = {(a, b) for order in orders for a, b in zip(order, order[1:])}
    assert len(after) == 12  # every method right after every other one
