"""The verify step: which drafted tokens the target keeps, and the token it adds.

Pure functions over tensors; every lossless guarantee of draftsmith lives here.

Shapes: ``n`` drafted tokens, vocabulary ``V``.
- ``draft_tokens``: [n] int64
- ``draft_probs``: [n, V] — the distribution each draft token was drawn from, or ``None`` for a
  deterministic drafter (n-gram, greedy model drafts), which is a one-hot proposal.
- target scores: [n + 1, V] — position i scores draft token i; position n gives the bonus token.

Both return ``(num_accepted, next_token)``: the first ``num_accepted`` draft tokens are kept and
``next_token`` (the correction at the first rejection, or the bonus token) is appended after them.
"""

from __future__ import annotations

import torch


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Keep draft tokens while they equal the target's argmax; then the target's own argmax."""
    target_tokens = target_logits.argmax(-1)  # [n + 1]
    n = draft_tokens.shape[0]
    mismatch = (draft_tokens != target_tokens[:n]).nonzero()
    accepted = int(mismatch[0, 0]) if mismatch.numel() else n
    return accepted, int(target_tokens[accepted])


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Leviathan et al. / Chen et al. speculative sampling.

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    draw from norm(max(0, p_i - q_i)); if all n are accepted draw a bonus token from p_n. The
    committed tokens are then distributed exactly as if drawn from the target one by one.
    """
    n = draft_tokens.shape[0]
    idx = torch.arange(n, device=draft_tokens.device)
    p_tok = target_probs[idx, draft_tokens]  # [n]
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)
    else:
        q_tok = draft_probs[idx, draft_tokens]
    u = torch.rand(n, generator=generator, device=target_probs.device)
    reject = u * q_tok > p_tok  # u < p/q  ⇔  accept, written without a division
    rejected = reject.nonzero()
    if not rejected.numel():
        bonus = torch.multinomial(target_probs[n], 1, generator=generator)
        return n, int(bonus)
    i = int(rejected[0, 0])
    if draft_probs is None:
        residual = target_probs[i].clone()
        residual[draft_tokens[i]] = 0.0
    else:
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: a rejection has probability ~0 here, fall back to p
        residual = target_probs[i]
    return i, int(torch.multinomial(residual, 1, generator=generator))
