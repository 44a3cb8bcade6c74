"""Batched greedy decoding (decode/batched.py): every sequence equals its unbatched output."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_target, tiny_tokenizer

from draftsmith.decode.batched import generate_batch
from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.speculative import generate
from draftsmith.decode.target import Target
from draftsmith.drafts.base import build_drafter

ARCHS = ["llama", "qwen2", "qwen3"]


def prompts() -> list[torch.Tensor]:
    """Different lengths; repetitive ones give the n-gram drafter long accepted runs, random ones none."""
    gen = torch.Generator().manual_seed(3)
    return [
        torch.tensor([7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]),
        torch.randint(0, 256, (3,), generator=gen),
        torch.tensor([50, 60, 50, 60, 50, 60, 50]),
        torch.randint(0, 256, (11,), generator=gen),
    ]


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param)


@pytest.mark.parametrize("spec", [None, "ngram", "layers:2"])
def test_batched_equals_unbatched(target, spec):
    batch = generate_batch(
        target, prompts(), build_drafter(spec, target) if spec else None, k=4, max_new_tokens=30
    )
    assert len(batch.sequences) == 4 and batch.new_tokens == sum(len(s.tokens) for s in batch.sequences)
    per_row_accepted = []
    for prompt, got in zip(prompts(), batch.sequences):
        drafter = build_drafter(spec, target) if spec else None
        alone = generate(target, prompt, drafter, k=4, max_new_tokens=30)
        assert got.tokens == alone.tokens
        assert got.stopped_by == alone.stopped_by
        assert len(got.accepted) == len(got.proposed) == got.target_forwards - 1
        assert all(p <= 4 for p in got.proposed)
        if spec == "ngram":  # proposals depend on the tokens alone: the very same steps
            assert (got.accepted, got.proposed) == (alone.accepted, alone.proposed)
        per_row_accepted.append(got.accepted)
    if spec:
        # rows accepted different numbers of drafts at the same step: the rollback had to handle holes
        steps = min(len(a) for a in per_row_accepted)
        assert any(len({a[i] for a in per_row_accepted}) > 1 for i in range(steps))
        assert sum(map(sum, per_row_accepted)) > 0
    else:
        assert batch.target_forwards == max(len(s.tokens) for s in batch.sequences)


def test_rows_that_stop_early_leave_the_batch(target):
    """Row 1's third greedy token is declared an EOS id, so that row stops while the others go on."""
    reference = [generate(target, p, None, max_new_tokens=12).tokens for p in prompts()]
    saved = target.eos_ids
    target.eos_ids = {reference[1][2]}
    try:
        batch = generate_batch(target, prompts(), build_drafter("ngram", target), k=3, max_new_tokens=12)
        for p, got in zip(prompts(), batch.sequences):
            alone = generate(target, p, build_drafter("ngram", target), k=3, max_new_tokens=12)
            assert got.tokens == alone.tokens and got.stopped_by == alone.stopped_by
        assert batch.sequences[1].stopped_by == "eos" and len(batch.sequences[1].tokens) <= 3
    finally:
        target.eos_ids = saved


def test_unsupported_drafts_and_models_are_refused():
    target = tiny_target("llama")

    class Odd(Drafter):  # a drafter with no batched form (as EAGLE and Medusa heads)
        name = "odd"

        def begin(self, prompt, features):
            pass

        def propose(self, tokens, k, sampling, generator):
            return Proposal(tokens[-1:].repeat(k))

        def commit(self, num_accepted, features):
            pass

    with pytest.raises(ValueError, match="'odd' has no batched form.*one sequence at a time"):
        generate_batch(target, prompts(), Odd(), k=2, max_new_tokens=4)
    sliding = Target(tiny_model("mistral"), tiny_tokenizer(), "tiny-mistral")
    with pytest.raises(ValueError, match="global attention"):
        generate_batch(sliding, prompts(), None, max_new_tokens=4)
