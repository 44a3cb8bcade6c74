"""Medusa objective: the heads of ``drafts/medusa.py`` trained on the target's last-layer features.

Alignment. Head i at position t reads the target's (normed) last hidden state at t and stands in for
target position t+1+i: it is scored against the target's next-token distribution there (soft CE on
the teacher's top-k, renormalised; the default) or against the data token t+2+i (``hard_labels``).
It counts iff token t is real and token t+2+i is a learnt token (``loss_mask``); each head's loss is
a mean over its counted positions, weighted ``head_decay ** i`` (later heads are harder and matter
less: they only count when every earlier head was right).
"""

from __future__ import annotations

import copy
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field
from pydantic.dataclasses import dataclass
from torch import nn

from draftsmith.drafts.base import MEDUSA
from draftsmith.drafts.medusa import MedusaConfig, MedusaHeads
from draftsmith.train.losses import soft_topk_cross_entropy
from draftsmith.train.objective import Batch, Objective, Teacher
from draftsmith.train.objectives.common import (
    chain_starts,
    masked_mean,
    shift_left,
    step_valid_masks,
    teacher_greedy,
)
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION


@dataclass(config=SECTION)
class MedusaOptions:
    """``draft.options`` of ``medusa``: the one declaration of each option, which ``MedusaObjective`` receives."""

    num_heads: Annotated[int, Field(ge=1)] = 4
    """Heads: head i drafts the token i + 1 places ahead, so at most num_heads tokens per step."""
    num_layers: Annotated[int, Field(ge=0)] = 1
    """Residual blocks per head."""
    shared_lm_head: bool = False
    """One frozen copy of the target's LM head for every head (only the blocks train) instead of one each."""
    hard_labels: bool = False
    """Cross-entropy on the data's tokens instead of the teacher's top-k distribution."""
    teacher_topk: Annotated[int, Field(ge=1)] = 64
    """The target's largest logits per position the soft targets are made of."""
    head_decay: float = 0.8
    """Weight of head i's loss is head_decay ** i (later heads count only when the earlier were right)."""


class MedusaObjective(Objective):
    """Medusa heads + per-head (soft or hard) cross-entropy; see the module docstring."""

    kind = MEDUSA

    def __init__(self, target, options: MedusaOptions | None = None):
        """``options``: the kind's ``draft.options`` (``MedusaOptions``, checked and filled in). With
        ``hard_labels`` the teacher's top-k is only needed for its greedy token (the accuracy logs and the
        simulated acceptance)."""
        o = MedusaOptions() if options is None else options
        self.options = o
        self.target = target
        self.config = MedusaConfig.for_target(target, o.num_heads, o.num_layers, o.shared_lm_head)
        self.capture_layers = tuple(self.config.capture_layer_ids)
        self.hard_labels = o.hard_labels
        self.teacher_topk = 1 if self.hard_labels else o.teacher_topk
        self.head_weights = [o.head_decay**i for i in range(o.num_heads)]

    def build_draft(self) -> MedusaHeads:
        heads = MedusaHeads(copy.deepcopy(self.config))
        heads.init_from_target(self.target.model)
        return heads

    def loss(self, draft: nn.Module, batch: Batch, teacher: Teacher) -> dict[str, torch.Tensor]:
        valid = step_valid_masks(batch, len(self.head_weights))  # [N, B, T]
        logits = draft(teacher.features[self.capture_layers[0]], logit_masks=valid)
        greedy = teacher_greedy(teacher)
        total = logits[0].new_zeros((), dtype=torch.float32)
        logs: dict[str, torch.Tensor] = {}
        for i, (weight, head_logits) in enumerate(zip(self.head_weights, logits)):
            sel = valid[i]
            if self.hard_labels:
                labels = shift_left(batch.input_ids, 2 + i)[sel]
                ce = F.cross_entropy(head_logits.float(), labels, reduction="none")
            else:
                ids = shift_left(teacher.topk_ids, 1 + i)[sel]
                ce, _ = soft_topk_cross_entropy(head_logits, shift_left(teacher.topk_logits, 1 + i)[sel], ids)
            head_loss = masked_mean(ce)
            total = total + weight * head_loss
            logs[f"ce_{i}"] = head_loss.detach()
            logs[f"acc_{i}"] = masked_mean((head_logits.argmax(-1) == shift_left(greedy, 1 + i)[sel]).float())
        logs["tokens"] = valid[0].sum().float()
        return {"loss": total, **logs}

    @torch.no_grad()
    def chain_lengths(
        self, draft: nn.Module, batch: Batch, teacher: Teacher, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B, T], starts [B, T]) for ``decoding_walk``: at each ``chain_starts`` position, the
        leading heads whose argmax equals the target's greedy token at their position (at most
        num_heads). Teacher forcing on the data equals decoding exactly where the data follows the
        target's greedy path."""
        starts = chain_starts(batch, k)
        accepted = torch.zeros(starts.shape, dtype=torch.long, device=starts.device)
        n = min(k, len(self.head_weights))
        if n < 1 or not starts.any():
            return accepted, starts
        logits = draft(teacher.features[self.capture_layers[0]], logit_masks=starts.expand(n, *starts.shape))
        greedy = teacher_greedy(teacher)
        matches = torch.stack(
            [head.argmax(-1) == shift_left(greedy, 1 + j)[starts] for j, head in enumerate(logits)], dim=-1
        )  # [N, n]
        accepted[starts] = matches.long().cumprod(-1).sum(-1)
        return accepted, starts


@register_objective(MEDUSA, options=MedusaOptions)
def _build(target, options: dict, token_counts=None) -> MedusaObjective:
    return MedusaObjective(target, MedusaOptions(**options))
