"""The verify step: greedy rules by hand, and the sampled rule checked statistically.

The statistical test runs whole speculative generations over a Markov-chain "target" and
"draft" with a 3-token vocabulary and compares the empirical distribution of the generated
sequences with the target's exact one. Its tolerance shrinks as 1/sqrt(samples). A verify rule
with the classic bug (resampling from p instead of norm(max(0, p - q)) after a rejection) must
fail the same test, which shows the test has the power to catch a broken rule.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from draftsmith.decode.sampling import Sampling, to_probs
from draftsmith.decode.verify import verify_greedy, verify_sampled


def one_hot_logits(tokens: list[int], vocab: int = 5) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return logits


def test_greedy_accepts_matching_prefix_and_returns_correction():
    draft = torch.tensor([1, 2, 3])
    assert verify_greedy(draft, one_hot_logits([1, 2, 4, 0])) == (2, 4)
    assert verify_greedy(draft, one_hot_logits([0, 2, 3, 0])) == (0, 0)


def test_greedy_all_accepted_gives_bonus_token():
    assert verify_greedy(torch.tensor([1, 2]), one_hot_logits([1, 2, 3])) == (2, 3)


def test_greedy_with_no_draft_is_plain_decoding():
    assert verify_greedy(torch.tensor([], dtype=torch.long), one_hot_logits([4])) == (0, 4)


def test_sampled_accepts_deterministic_draft_that_target_is_sure_of():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    n, nxt = verify_sampled(torch.tensor([1, 2]), None, p, torch.Generator().manual_seed(0))
    assert (n, nxt) == (2, 0)


def test_sampled_never_returns_rejected_one_hot_token():
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, nxt = verify_sampled(torch.tensor([0]), None, p, g)
        if n == 0:
            assert nxt == 1  # the residual of a one-hot proposal excludes the rejected token


# --- the statistical test -------------------------------------------------------------------

V, LENGTH, K = 3, 3, 2
TARGET = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.7, 0.2]])  # P(next | prev)
DRAFT = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.4, 0.1], [0.3, 0.3, 0.4]])  # Q(next | prev), far from P
START = 0


def exact_distribution() -> dict[tuple[int, ...], float]:
    probs = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob, prev = 1.0, START
        for tok in seq:
            prob *= float(TARGET[prev, tok])
            prev = tok
        probs[seq] = prob
    return probs


def speculative_sequence(verify, generator: torch.Generator, sampled_draft: bool) -> tuple[int, ...]:
    """Generate LENGTH tokens with chain drafting of K tokens and the given verify rule."""
    seq: list[int] = []
    while len(seq) < LENGTH:
        prev = seq[-1] if seq else START
        drafted, dists = [], []
        for _ in range(K):
            q = DRAFT[prev] if sampled_draft else torch.nn.functional.one_hot(DRAFT[prev].argmax(), V).float()
            tok = int(torch.multinomial(q, 1, generator=generator))
            drafted.append(tok)
            dists.append(q)
            prev = tok
        context = [seq[-1] if seq else START, *drafted]
        target_probs = TARGET[torch.tensor(context)]  # [K + 1, V]
        probs = torch.stack(dists) if sampled_draft else None
        n, nxt = verify(torch.tensor(drafted), probs, target_probs, generator)
        seq.extend(drafted[:n] + [nxt])
    return tuple(seq[:LENGTH])


def max_normalised_deviation(verify, samples: int, sampled_draft: bool) -> float:
    """Largest |empirical - exact| / standard error over all V**LENGTH sequences."""
    g = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        s = speculative_sequence(verify, g, sampled_draft)
        counts[s] = counts.get(s, 0) + 1
    worst = 0.0
    for seq, p in exact_distribution().items():
        stderr = math.sqrt(p * (1 - p) / samples)
        worst = max(worst, abs(counts.get(seq, 0) / samples - p) / stderr)
    return worst


def verify_resampling_from_p(draft_tokens, draft_probs, target_probs, generator):
    """A broken rule: on rejection it draws from p, not from the residual max(0, p - q)."""
    n = draft_tokens.shape[0]
    for i in range(n):
        p, q = float(target_probs[i, draft_tokens[i]]), float(draft_probs[i, draft_tokens[i]])
        if float(torch.rand(1, generator=generator)) * q > p:
            return i, int(torch.multinomial(target_probs[i], 1, generator=generator))
    return n, int(torch.multinomial(target_probs[n], 1, generator=generator))


# 27 outcomes; with 4.5 standard errors as the bound a correct rule fails with probability < 2e-4
BOUND = 4.5
SAMPLES = 6000


@pytest.mark.parametrize("sampled_draft", [True, False], ids=["sampled-draft", "one-hot-draft"])
def test_speculative_sampling_matches_target_distribution(sampled_draft):
    assert max_normalised_deviation(verify_sampled, SAMPLES, sampled_draft) < BOUND


def test_broken_acceptance_rule_fails_the_same_test():
    assert max_normalised_deviation(verify_resampling_from_p, SAMPLES, sampled_draft=True) > BOUND


def test_to_probs_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    probs = to_probs(logits, Sampling(temperature=1.0, top_k=2))
    assert probs[2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)  # ≈ [0.644, 0.237, 0.087, 0.032]
    probs = to_probs(logits, Sampling(temperature=1.0, top_p=0.7))
    assert probs[2:].sum() == 0 and probs[1] > 0  # 0.644 < 0.7 so the second token stays
    probs = to_probs(logits, Sampling(temperature=1.0, top_p=0.5))
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(to_probs(logits, Sampling(temperature=1.0)), full)
