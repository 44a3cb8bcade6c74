"""What the objectives of heads on the target's hidden states share: which anchors count at which
unroll step of a (possibly packed) row, the target's greedy token, a mean over selected positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.drafts.eagle_parts import packed_segments
from draftsmith.train.objective import Batch, Teacher


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end back to length T (dim 1)."""
    pad = [0, 0] * (x.dim() - 2) + [0, n]
    return F.pad(x[:, n:], pad)


def same_conversation(batch: Batch, offset: int) -> torch.Tensor:
    """[B, T] bool: token t and token t+offset belong to the same conversation (packed rows hold several)."""
    if batch.position_ids is None:
        return torch.ones_like(batch.attention_mask, dtype=torch.bool)
    segments = packed_segments(batch.position_ids)
    return segments == shift_left(segments, offset)


def step_valid_masks(batch: Batch, steps: int) -> torch.Tensor:
    """[steps, B, T] bool: anchor t counts at step j iff token t is real and token t+2+j is learnt
    and in the same conversation as token t."""
    real = batch.attention_mask.bool()
    learnt = batch.loss_mask.bool() & real
    return torch.stack(
        [real & shift_left(learnt, 2 + j) & same_conversation(batch, 2 + j) for j in range(steps)]
    )


def chain_starts(batch: Batch, k: int) -> torch.Tensor:
    """[B, T] bool: anchors where decoding starts a k-chain — token t+1 is learnt (the target produced
    it, so not an answer's first token, which the prefill gives) and token t+2 too, with k real tokens
    of the same conversation after t."""
    real = batch.attention_mask.bool()
    learnt = real & batch.loss_mask.bool()
    return (
        step_valid_masks(batch, 1)[0]
        & shift_left(learnt, 1)
        & shift_left(real, k)
        & same_conversation(batch, k)
    )


def teacher_greedy(teacher: Teacher) -> torch.Tensor:
    """The target's greedy next token [B, T] from its top-k."""
    best = teacher.topk_logits.argmax(-1, keepdim=True)
    return teacher.topk_ids.gather(-1, best).squeeze(-1)


def masked_mean(values: torch.Tensor) -> torch.Tensor:
    """The mean of the selected values (0 when none was selected, so an empty step adds nothing)."""
    return values.sum() / max(values.numel(), 1)
