"""Distillation losses against hand-computed values, and the properties the loop relies on."""

import math

import numpy as np
import pytest
import torch

from draftsmith.train import losses as L

DIVERGENCES = {
    "fkl": L.forward_kl,
    "rkl": L.reverse_kl,
    "tvd": L.total_variation,
    "jsd": lambda d, t, m, **kw: L.generalized_jsd(d, t, m, 0.5, **kw),
}


def _as_logits(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


# position 0: teacher p = [1/2, 1/4, 1/4], draft q = [1/4, 1/2, 1/4]; position 1: both uniform.
# Worked out by hand: KL(p||q) = 1/2 ln 2 - 1/4 ln 2 = 1/4 ln 2, KL(q||p) = 1/4 ln 2 likewise,
# TVD = 1/2 (1/4 + 1/4) = 1/4, m = [3/8, 3/8, 1/4] so JSD_0.5 = 1/2 ln(4/3) + 1/4 ln(2/3).
TEACHER = _as_logits([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]])
DRAFT = _as_logits([[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]])
BY_HAND = {
    "fkl": 0.25 * math.log(2),
    "rkl": 0.25 * math.log(2),
    "tvd": 0.25,
    "jsd": 0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3),
}


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_hand_computed_values(name):
    mask = torch.ones(2, dtype=torch.bool)
    result = DIVERGENCES[name](DRAFT, TEACHER, mask)
    assert int(result.count) == 2
    assert float(result.total) == pytest.approx(BY_HAND[name], abs=1e-6)
    assert float(result.mean()) == pytest.approx(BY_HAND[name] / 2, abs=1e-6)


def test_cross_entropy_by_hand():
    mask = torch.ones(2, dtype=torch.bool)
    labels = L.teacher_labels(TEACHER)  # argmax: token 0 at position 0, token 0 at position 1 (tie → first)
    assert labels.tolist() == [0, 0]
    result = L.cross_entropy(DRAFT, labels, mask)
    assert float(result.total) == pytest.approx(math.log(4) + math.log(3), abs=1e-6)


def _np_reference(name, draft, teacher, beta=0.5, temperature=1.0):
    def softmax(x):
        e = np.exp(x / temperature - (x / temperature).max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(teacher.astype(np.float64)), softmax(draft.astype(np.float64))

    def kl(a, b):
        return (a * np.log(a / b)).sum(-1)

    if name == "fkl":
        return kl(p, q)
    if name == "rkl":
        return kl(q, p)
    if name == "tvd":
        return 0.5 * np.abs(p - q).sum(-1)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_matches_numpy_with_mask_and_temperature(name):
    gen = torch.Generator().manual_seed(0)
    draft, teacher = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 5, generator=gen)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    draft[0, 1] = float("nan")  # a masked-out position must not leak into the result
    result = DIVERGENCES[name](draft, teacher, mask, temperature=2.0)
    per_token = _np_reference(name, draft.numpy(), teacher.numpy(), temperature=2.0)
    expected = per_token[mask.numpy().astype(bool)].sum()
    assert int(result.count) == 4
    assert float(result.total) == pytest.approx(expected, rel=1e-5)


def test_temperature_softens_both_distributions():
    gen = torch.Generator().manual_seed(1)
    draft, teacher = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    mask = torch.ones(4, dtype=torch.bool)
    at_two = L.forward_kl(2 * draft, 2 * teacher, mask, temperature=2.0)
    assert float(at_two.total) == pytest.approx(float(L.forward_kl(draft, teacher, mask).total), rel=1e-5)


def test_jsd_limits_are_forward_and_reverse_kl():
    gen = torch.Generator().manual_seed(2)
    draft, teacher = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    mask = torch.ones(3, dtype=torch.bool)
    fkl = float(L.forward_kl(draft, teacher, mask).total)
    rkl = float(L.reverse_kl(draft, teacher, mask).total)
    assert fkl != pytest.approx(rkl, rel=1e-2)  # the two limits are distinguishable here
    eps = 1e-3
    assert float(L.generalized_jsd(draft, teacher, mask, eps).total) / eps == pytest.approx(fkl, rel=1e-2)
    assert float(L.generalized_jsd(draft, teacher, mask, 1 - eps).total) / eps == pytest.approx(rkl, rel=1e-2)
    assert float(L.generalized_jsd(draft, teacher, mask, 0.0).total) == pytest.approx(fkl)
    assert float(L.generalized_jsd(draft, teacher, mask, 1.0).total) == pytest.approx(rkl)
    with pytest.raises(ValueError, match="beta"):
        L.generalized_jsd(draft, teacher, mask, 1.5)


@pytest.mark.parametrize("name", sorted(DIVERGENCES) + ["ce"])
def test_gradients_finite_and_zero_at_the_teacher(name):
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(2, 4, 7, generator=gen)
    mask = torch.rand(2, 4, generator=gen) > 0.3
    for draft_init, zero in ((torch.randn(2, 4, 7, generator=gen), False), (teacher.clone(), True)):
        draft = draft_init.requires_grad_(True)
        result = L.distillation_loss(name, draft, teacher, mask, beta=0.3, temperature=1.5)
        result.total.backward()
        assert torch.isfinite(draft.grad).all()
        assert draft.grad[~mask].abs().max() == 0  # masked positions get no gradient
        if zero and name != "ce":
            assert float(result.total.detach()) == pytest.approx(0.0, abs=1e-6)
            assert draft.grad.abs().max() < 1e-6


@pytest.mark.parametrize("name", sorted(DIVERGENCES) + ["ce"])
def test_gradient_accumulation_invariance(name):
    gen = torch.Generator().manual_seed(4)
    draft_full = torch.randn(4, 5, 6, generator=gen)
    teacher = torch.randn(4, 5, 6, generator=gen)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[0, :1] = True  # micro-batches with very different token counts
    mask[1:, :] = True

    whole = draft_full.clone().requires_grad_(True)
    n_total = L.token_count(mask)
    L.distillation_loss(name, whole, teacher, mask).mean(n_total).backward()

    split = draft_full.clone().requires_grad_(True)
    per_micro_means = []
    for rows in (slice(0, 1), slice(1, 4)):
        micro = L.distillation_loss(name, split[rows], teacher[rows], mask[rows])
        micro.mean(n_total).backward()  # normalised by the whole step's token count
        per_micro_means.append(float(micro.mean()))
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-5, atol=1e-7)
    # averaging per-micro-batch means instead would weight the lone token of micro-batch 1 15x
    full_mean = float(L.distillation_loss(name, draft_full, teacher, mask).mean())
    assert np.mean(per_micro_means) != pytest.approx(full_mean, rel=1e-3)


def _topk(teacher, k, gen):
    """Teacher top-k as (values, ids), shuffled within k so nothing relies on sorted order."""
    values, ids = teacher.topk(k, dim=-1)
    order = torch.argsort(torch.rand(values.shape, generator=gen), dim=-1)
    return values.gather(-1, order), ids.gather(-1, order)


@pytest.mark.parametrize("name", sorted(DIVERGENCES) + ["ce"])
def test_topk_with_k_equal_vocab_matches_full(name):
    gen = torch.Generator().manual_seed(5)
    draft, teacher = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    values, ids = _topk(teacher, 8, gen)
    full = L.distillation_loss(name, draft, teacher, mask, beta=0.3, temperature=0.7)
    topk = L.distillation_loss(name, draft, values, mask, teacher_ids=ids, beta=0.3, temperature=0.7)
    assert float(topk.total) == pytest.approx(float(full.total), rel=1e-5, abs=1e-6)


def test_topk_support_and_rest_bucket_by_formula():
    gen = torch.Generator().manual_seed(6)
    draft, teacher = torch.randn(1, 6, generator=gen), torch.randn(1, 6, generator=gen)
    mask = torch.ones(1, dtype=torch.bool)
    values, ids = _topk(teacher, 3, gen)
    p_s = torch.softmax(values[0].double(), -1)  # teacher renormalised over its top 3
    q = torch.softmax(draft[0].double(), -1)
    q_s = q[ids[0]]
    q_rest = 1 - q_s.sum()
    fkl = (p_s * (p_s / q_s).log()).sum()
    rkl = (q_s * (q_s / p_s).log()).sum() + q_rest * (q_rest / L.REST_FLOOR).log()
    tvd = 0.5 * ((p_s - q_s).abs().sum() + q_rest)
    kw = dict(teacher_ids=ids)
    assert float(L.forward_kl(draft, values, mask, **kw).total) == pytest.approx(float(fkl), rel=1e-5)
    assert float(L.reverse_kl(draft, values, mask, **kw).total) == pytest.approx(float(rkl), rel=1e-5)
    assert float(L.total_variation(draft, values, mask, **kw).total) == pytest.approx(float(tvd), rel=1e-5)
    for name in DIVERGENCES:  # every top-k loss still has finite gradients
        d = draft.clone().requires_grad_(True)
        L.distillation_loss(name, d, values, mask, **kw).total.backward()
        assert torch.isfinite(d.grad).all()


def test_empty_mask_and_bad_shapes():
    draft, teacher = torch.randn(2, 4), torch.randn(2, 4)
    empty = L.forward_kl(draft, teacher, torch.zeros(2, dtype=torch.bool))
    assert int(empty.count) == 0 and float(empty.mean()) == 0.0
    with pytest.raises(ValueError, match="mask"):
        L.forward_kl(draft, teacher, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="teacher_ids"):
        L.forward_kl(draft, teacher[:, :2], torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="unknown distillation loss"):
        L.distillation_loss("kl", draft, teacher, torch.ones(2, dtype=torch.bool))


# ---- acceptance-oriented losses and weights (EAGLE-3 recipe options)


def test_dpace_weights_by_hand():
    """q̃ = (1 - α) q + α; C_j = Π_{i≤j} q̃_i; w_j = Σ_{m≥j} C_m over valid m, 0 where j is not valid."""
    confidence = torch.tensor([[0.6], [0.2], [1.0]])
    valid = torch.ones(3, 1, dtype=torch.bool)
    w = L.dpace_weights(confidence, valid, 0.5)  # q̃ = .8 .6 1 → C = .8 .48 .48
    assert torch.allclose(w[:, 0], torch.tensor([1.76, 0.96, 0.48]))
    valid[1] = False  # q̃_1 = 1, C_1 left out
    assert torch.allclose(L.dpace_weights(confidence, valid, 0.5)[:, 0], torch.tensor([1.6, 0.0, 0.8]))
    assert torch.equal(L.dpace_weights(confidence, torch.ones(3, 1, dtype=torch.bool), 1.0)[:, 0],
                       torch.tensor([3.0, 2.0, 1.0]))  # fmt: skip
    grad = confidence.clone().requires_grad_()
    assert not L.dpace_weights(grad, valid).requires_grad
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        L.dpace_weights(confidence, valid, 0.0)


def test_topk_acceptance_and_lk_hybrid_by_hand():
    """α = Σ min(p, q) over the ids the draft scores; LK^λ = λ KL + (1 - λ)(1 - α), λ = exp(-3α); its gradient in
    the draft's logits is λ (q - p) - (1 - λ) ∂α/∂z, with ∂α/∂z_v = 1[q_v < p_v] q_v - q_v Σ_u 1[q_u < p_u] q_u."""
    draft = torch.tensor([[0.5, -1.0, 2.0, 0.0]], requires_grad=True)
    teacher = torch.tensor(
        [[1.0, 0.0, -3.0, 9.0]]
    )  # top-4 logits; the last id is outside the draft vocabulary
    ids = torch.tensor([[1, 0, 2, -1]])
    p = torch.tensor([1.0, 0.0, -3.0]).softmax(-1)  # teacher over the in-vocabulary ids, draft ids 1, 0, 2
    q = draft.detach()[0].softmax(-1)
    p_draft = torch.zeros(4)
    p_draft[[1, 0, 2]] = p
    alpha = L.topk_acceptance(draft, teacher, ids)
    assert torch.allclose(alpha, torch.minimum(p_draft, q).sum()[None])
    ce, _ = L.soft_topk_cross_entropy(draft, teacher, ids)
    kl = ce - L.teacher_entropy(teacher, ids)
    assert torch.allclose(kl, (p_draft[:3] * (p_draft[:3].log() - q[:3].log())).sum()[None], atol=1e-6)
    loss = L.lk_hybrid(kl, alpha)
    lam = math.exp(-3 * float(alpha.detach()))
    assert torch.allclose(loss, lam * kl + (1 - lam) * (1 - alpha))
    loss.sum().backward()
    below = (q < p_draft).float()
    d_alpha = below * q - q * (below * q).sum()
    assert torch.allclose(draft.grad[0], lam * (q - p_draft) - (1 - lam) * d_alpha, atol=1e-6)
