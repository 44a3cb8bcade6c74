"""Distillation losses between a draft's and the teacher's next-token distributions.

One pure function per loss. Inputs are logits ``[..., V]`` (``[N, V]`` or ``[B, T, V]``) and a
``mask`` over the leading dims (1 = this position counts). Conventions, used by every function:

- ``p`` is the teacher, ``q`` the draft. Forward KL is ``KL(p || q)`` (mass-covering), reverse KL
  is ``KL(q || p)`` (mode-seeking).
- ``temperature`` T softens both: ``p = softmax(teacher / T)``, ``q = softmax(draft / T)``. The
  result is the divergence between the softened distributions, *not* multiplied by T² (Hinton et
  al. scale by T² to keep gradient sizes comparable across temperatures; a caller that wants that
  multiplies the result).
- Generalized JSD as in GKD / DistillSpec (and TRL's ``generalized_jsd_loss``):
  ``JSD_β(p || q) = β KL(p || m) + (1 - β) KL(q || m)``, ``m = β p + (1 - β) q``. It tends to
  ``β · KL(p || q)`` as β → 0 and to ``(1 - β) · KL(q || p)`` as β → 1, so β = 0 returns forward KL
  and β = 1 reverse KL exactly (the limits of ``JSD_β / β`` and ``JSD_β / (1 - β)``); β = 0.5 is
  the ordinary Jensen-Shannon divergence.
- Total variation is ``½ Σ |p - q|``.

Normalisation. Every function returns a ``TokenLoss``: the *sum* of the per-token loss over the
masked positions and their *count*. Dividing by the count of the whole optimiser step (not of each
micro-batch) makes gradient accumulation exact: for micro-batches b_1..b_m of one step, let
``N = Σ_i count_i`` (known up front from the masks, ``token_count``); backpropagate
``loss_i.total / N`` for each. The accumulated gradient then equals that of one pass over the whole
batch, however it is split. Under data parallelism that averages gradients over W ranks, use the
all-reduced N and backpropagate ``total * W / N``.

Top-k teacher. Passing ``teacher_ids`` ``[..., K]`` says ``teacher_logits`` holds only the teacher's
K largest logits ``[..., K]``. The divergence is then computed over K + 1 buckets: the K support ids
and one "rest" bucket for every other id. The teacher is renormalised over its top-k (rest = 0: the
approximation is that the teacher puts no mass outside its top k); the draft keeps its true
full-vocabulary probabilities on the support and its remaining mass in the rest bucket, so every
loss pushes draft mass into the teacher's support. With K = V the rest bucket is exactly empty and
the result equals the full-logits loss. Reverse KL would be infinite whenever the draft puts mass
where the teacher has none, so for reverse KL (only) the teacher's rest bucket is given the small
mass ``rest_floor`` (default 1e-6) inside the log: the rest term is ``q_rest · log(q_rest / rest_floor)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

REST_FLOOR = 1e-6
_TINY = 1e-30  # keeps log(0) finite where a zero-mass bucket meets a log; the term it sits in is 0


class TokenLoss(NamedTuple):
    """A loss summed over masked tokens, and how many tokens that was."""

    total: torch.Tensor
    """Scalar, differentiable: Σ over masked positions of the per-token loss."""
    count: torch.Tensor
    """Scalar int64: number of masked positions."""

    def mean(self, num_tokens: int | float | torch.Tensor | None = None) -> torch.Tensor:
        """``total / num_tokens`` (default: this loss's own count; 0 tokens gives 0, not NaN)."""
        denom = self.count if num_tokens is None else num_tokens
        return self.total / torch.as_tensor(
            denom, dtype=self.total.dtype, device=self.total.device
        ).clamp_min(1)


def token_count(mask: torch.Tensor) -> torch.Tensor:
    """Number of positions a loss over ``mask`` averages over (sum this over micro-batches for N)."""
    return mask.bool().sum()


def _select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows of x [..., D] at the masked positions: [N, D]."""
    if mask.shape != x.shape[:-1]:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match logits of shape {tuple(x.shape)}")
    return x[mask.bool()]


def _log_distributions(
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    teacher_ids: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Teacher and draft log-probabilities [N, S] over the support; True if the last column is "rest"."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_q = torch.log_softmax(_select(draft_logits, mask).float() / temperature, dim=-1)
    teacher = _select(teacher_logits, mask).float().detach() / temperature
    if teacher_ids is None:
        if teacher.shape[-1] != log_q.shape[-1]:
            raise ValueError(
                f"teacher logits have {teacher.shape[-1]} entries per position but the draft has {log_q.shape[-1]}: "
                "pass teacher_ids when the teacher logits are a top-k selection"
            )
        return torch.log_softmax(teacher, dim=-1), log_q, False
    ids = _select(teacher_ids, mask).long()
    if ids.shape != teacher.shape:
        raise ValueError(
            f"teacher ids {tuple(ids.shape)} and top-k logits {tuple(teacher.shape)} differ in shape"
        )
    log_p = torch.log_softmax(teacher, dim=-1)  # renormalised over the top-k support
    outside = torch.ones_like(log_q, dtype=torch.bool).scatter(-1, ids, False)
    # the draft's mass outside the support, summed as probabilities: exactly 0 when K = V
    q_rest = (log_q.exp() * outside).sum(-1, keepdim=True)
    log_q_support = torch.cat([log_q.gather(-1, ids), q_rest.clamp_min(_TINY).log()], dim=-1)
    log_p_support = torch.cat([log_p, torch.full_like(log_p[:, :1], -math.inf)], dim=-1)
    return log_p_support, log_q_support, True


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row, with 0 · log 0 = 0 where a has no mass."""
    a = log_a.exp()
    return (a * torch.where(a > 0, log_a - log_b, 0.0)).sum(-1)


def _result(per_token: torch.Tensor, mask: torch.Tensor) -> TokenLoss:
    return TokenLoss(per_token.sum(), token_count(mask))


def forward_kl(
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    teacher_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> TokenLoss:
    """Σ over masked positions of KL(p_teacher || q_draft)."""
    log_p, log_q, _ = _log_distributions(draft_logits, teacher_logits, mask, teacher_ids, temperature)
    return _result(_kl(log_p, log_q), mask)


def reverse_kl(
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    teacher_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    rest_floor: float = REST_FLOOR,
) -> TokenLoss:
    """Σ over masked positions of KL(q_draft || p_teacher); top-k: teacher rest mass floored at rest_floor."""
    log_p, log_q, has_rest = _log_distributions(draft_logits, teacher_logits, mask, teacher_ids, temperature)
    if has_rest:
        log_p = torch.cat([log_p[:, :-1], torch.full_like(log_p[:, -1:], math.log(rest_floor))], dim=-1)
    return _result(_kl(log_q, log_p), mask)


def generalized_jsd(
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    *,
    teacher_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> TokenLoss:
    """Σ over masked positions of β KL(p || m) + (1 - β) KL(q || m), m = β p + (1 - β) q.

    β = 0 is forward KL and β = 1 reverse KL (the normalised limits, see the module docstring).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"JSD beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")
    if beta == 0.0:
        return forward_kl(
            draft_logits, teacher_logits, mask, teacher_ids=teacher_ids, temperature=temperature
        )
    if beta == 1.0:
        return reverse_kl(
            draft_logits, teacher_logits, mask, teacher_ids=teacher_ids, temperature=temperature
        )
    log_p, log_q, _ = _log_distributions(draft_logits, teacher_logits, mask, teacher_ids, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)
    per_token = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    return _result(per_token, mask)


def total_variation(
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    teacher_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> TokenLoss:
    """Σ over masked positions of ½ Σ_v |p(v) - q(v)|.

    1 - TVD is the chance a sampled draft token is accepted by speculative sampling, which is why
    DistillSpec lists it.
    """
    log_p, log_q, _ = _log_distributions(draft_logits, teacher_logits, mask, teacher_ids, temperature)
    return _result(0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1), mask)


def teacher_labels(teacher_logits: torch.Tensor, teacher_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The teacher's greedy token at each position [...]: argmax of full logits, or of the top-k."""
    best = teacher_logits.argmax(-1, keepdim=True)
    if teacher_ids is None:
        return best.squeeze(-1)
    return teacher_ids.gather(-1, best).squeeze(-1)


def cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> TokenLoss:
    """Σ over masked positions of -log q_draft(label): hard distillation on given tokens.

    ``labels`` [...] are the teacher's greedy tokens (``teacher_labels``) or the data's next tokens.
    """
    if labels.shape != mask.shape:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the mask {tuple(mask.shape)}")
    log_q = torch.log_softmax(_select(draft_logits, mask).float(), dim=-1)
    picked = log_q.gather(-1, labels[mask.bool()].long().unsqueeze(-1)).squeeze(-1)
    return _result(-picked, mask)


LOSSES = ("fkl", "rkl", "jsd", "tvd", "ce")


def distillation_loss(
    name: str,
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    teacher_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.5,
    labels: torch.Tensor | None = None,
) -> TokenLoss:
    """Dispatch by name (``fkl``, ``rkl``, ``jsd``, ``tvd``, ``ce``); ``ce`` uses ``labels`` or the teacher's argmax."""
    common = dict(teacher_ids=teacher_ids, temperature=temperature)
    if name == "fkl":
        return forward_kl(draft_logits, teacher_logits, mask, **common)
    if name == "rkl":
        return reverse_kl(draft_logits, teacher_logits, mask, **common)
    if name == "jsd":
        return generalized_jsd(draft_logits, teacher_logits, mask, beta, **common)
    if name == "tvd":
        return total_variation(draft_logits, teacher_logits, mask, **common)
    if name == "ce":
        if labels is None:
            labels = teacher_labels(teacher_logits, teacher_ids)
        return cross_entropy(draft_logits, labels, mask)
    raise ValueError(f"unknown distillation loss {name!r}; choose one of {', '.join(LOSSES)}")


def soft_topk_cross_entropy(
    draft_logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_draft_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the draft against the teacher's top-k, renormalised over ids the draft can score.

    draft_logits [N, Vd]; teacher_logits [N, K]; teacher_draft_ids [N, K] (draft ids, -1 = not in the
    draft vocabulary). Returns per-position CE [N] and whether the position had any in-vocabulary mass [N].
    """
    in_vocab = teacher_draft_ids >= 0
    p = teacher_logits.float().masked_fill(~in_vocab, float("-inf")).softmax(-1).nan_to_num(0.0)
    log_q = draft_logits.float().log_softmax(-1).gather(-1, teacher_draft_ids.clamp_min(0))
    return -(p * log_q).sum(-1), in_vocab.any(-1)


def topk_acceptance(
    draft_logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_draft_ids: torch.Tensor
) -> torch.Tensor:
    """α = Σ_v min(p_v, q_v) per position [N]: the chance speculative sampling accepts a token drafted from q
    when the target samples from p (1 - total variation). p is the teacher's top-k renormalised over the ids the
    draft can score (as ``soft_topk_cross_entropy``; its other ids have p = 0, so min is 0 there); q the draft's
    full softmax. Arguments as ``soft_topk_cross_entropy``."""
    in_vocab = teacher_draft_ids >= 0
    p = teacher_logits.float().masked_fill(~in_vocab, float("-inf")).softmax(-1).nan_to_num(0.0)
    q = draft_logits.float().softmax(-1).gather(-1, teacher_draft_ids.clamp_min(0))
    return torch.minimum(p, q).sum(-1)


def lk_hybrid(kl: torch.Tensor, acceptance: torch.Tensor, eta: float = 3.0) -> torch.Tensor:
    """LK^λ (arXiv 2602.23881, speculators' ``lk_hybrid``) per position: λ·KL(p || q) + (1 - λ)·(1 - α) with
    λ = exp(-η·α) per position, α detached in λ: KL leads while the draft is far from the target (where
    total variation's gradient vanishes), acceptance once it is close. kl, acceptance [N] → [N]."""
    weight = torch.exp(-eta * acceptance.detach())
    return weight * kl + (1.0 - weight) * (1.0 - acceptance)


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE (arXiv 2605.18810) weights [J, ...] of the J positions of a chain, detached.

    ``confidence`` [J, ...] in [0, 1]: the draft's chance of getting position j right (its probability of the
    target's token); ``valid`` [J, ...] bool. With q̃_j = (1 - α)·q_j + α (1 where not valid), C_j = Π_{i≤j} q̃_i
    the chance the chain reaches past j, the weight of j is w_j = Σ_{m≥j} C_m (valid m only): the credit for
    every position a right token at j lets decoding reach. α in (0, 1] floors q̃ (α = 1: equal weights)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"D-PACE alpha must be in (0, 1], got {alpha}")
    valid = valid.bool()
    smoothed = torch.where(valid, (1.0 - alpha) * confidence.detach().float() + alpha, 1.0)
    reach = smoothed.cumprod(0) * valid
    return reach.flip(0).cumsum(0).flip(0) * valid


def teacher_entropy(teacher_logits: torch.Tensor, teacher_draft_ids: torch.Tensor) -> torch.Tensor:
    """H(p) per position [N] of the teacher's top-k renormalised over the draft's ids (as
    ``soft_topk_cross_entropy``): that cross-entropy minus this is KL(p || q)."""
    in_vocab = teacher_draft_ids >= 0
    log_p = teacher_logits.float().masked_fill(~in_vocab, float("-inf")).log_softmax(-1)
    return -(log_p.exp() * log_p.nan_to_num(0.0, neginf=0.0)).sum(-1).nan_to_num(0.0)
