"""P-EAGLE objective: the parallel EAGLE-3 head of ``drafts/peagle.py`` trained in one forward per batch.

Alignment is EAGLE-3's (``train/objectives/eagle.py``): the real pair at anchor t, (feature_t, token_{t+1}),
stands in for target position t+1; the slot at depth d of anchor t for position t+1+d, scored against the
target's next-token distribution there (the top-k teacher in the draft vocabulary, soft CE). It counts
iff token t is real and token t+2+d is learnt and in t's conversation (``step_valid_masks``).

Depth sampling (the peers' "conditional drop": SpecForge's and speculators' P-EAGLE trainers). A row has
more anchors than a forward can unroll ``parallel_depths - 1`` slots for, so the anchors eligible at
depth 1, shuffled, keep slots down to depth d for the first ``max(depth_ratio ** d, depth_ratio_min)`` of
them: every anchor with a slot at depth d has its slots at 1..d-1, as decoding does. The loss is one
mean over every counted prediction, real pairs (depth 0) and slots alike.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass
from torch import nn

from draftsmith.drafts.base import DRAFT_KIND_KEY, PEAGLE, check_mask_token, default_mask_token
from draftsmith.train.losses import soft_topk_cross_entropy
from draftsmith.train.objective import Batch, Teacher
from draftsmith.train.objectives.common import (
    chain_starts,
    masked_mean,
    step_valid_masks,
    teacher_greedy,
)
from draftsmith.train.objectives.eagle import Eagle3Options, EagleObjective, _unwrap
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION

VALIDATION_ANCHORS = 128
"""Chain starts per forward when validation drafts a chain at every start of a row."""


@dataclass(config=SECTION)
class PEagleOptions:
    """``draft.options`` of ``peagle``: the one declaration of each option, which ``PEagleObjective`` receives."""

    parallel_depths: Annotated[int, Field(ge=2, le=32)] = 8
    """Tokens one forward drafts: the real pair's and parallel_depths - 1 slots' (the peers' default, 8)."""
    num_layers: Annotated[int, Field(ge=1)] = 1
    """Decoder layers in the head (the engines' EAGLE-3 layout has one)."""
    capture_layer_ids: list[int] | None = None
    """Target layers the head reads (0-based outputs; null = EAGLE-3's low / middle / high)."""
    draft_vocab_size: Annotated[int, Field(ge=1)] | None = None
    """The draft vocabulary: the training data's most frequent tokens (null = 32000, at most the target's)."""
    mask_token_id: int | None = None
    """The token embedded at the slots drafted in parallel (null = the tokenizer's mask, unknown or padding token)."""
    depth_ratio: Annotated[float, Field(gt=0, le=1)] = 0.7
    """The share of depth-1 anchors that keeps a slot at depth d is depth_ratio ** d (the peers' 0.7)..."""
    depth_ratio_min: Annotated[float, Field(ge=0, le=1)] = 0.2
    """...but never below this share (the peers' 0.2)."""
    anchors_per_row: Annotated[int, Field(ge=1)] | None = None
    """At most this many anchors per row get slots (null = every eligible one)."""
    teacher_topk: Annotated[int, Field(ge=1)] = 64
    """The target's largest logits per position the soft targets are made of."""


class PEagleObjective(EagleObjective):
    """A P-EAGLE head and its one-forward loss; see the module docstring."""

    def __init__(
        self, target, options: PEagleOptions | None = None, token_counts: torch.Tensor | None = None
    ):
        """``options``: the kind's ``draft.options`` (``PEagleOptions``, checked and filled in); the head is
        an EAGLE-3 head with one training-time step."""
        o = PEagleOptions() if options is None else options
        head = Eagle3Options(num_layers=o.num_layers, capture_layer_ids=o.capture_layer_ids,
                             draft_vocab_size=o.draft_vocab_size, ttt_steps=1, teacher_topk=o.teacher_topk)  # fmt: skip
        super().__init__(target, head, token_counts)
        self.options = o
        vocab = self.config.vocab_size
        mask = default_mask_token(target.tokenizer, vocab) if o.mask_token_id is None else o.mask_token_id
        self.config.mask_token_id = check_mask_token(mask, vocab)
        self.config.parallel_depths = o.parallel_depths
        setattr(self.config, DRAFT_KIND_KEY, PEAGLE)
        self.depth_shares = [max(o.depth_ratio**d, o.depth_ratio_min) for d in range(1, o.parallel_depths)]
        self.anchors_per_row = o.anchors_per_row

    def sample_slots(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(anchors, depths, keep) [B, S]: the depth-sampled slots of each row (module docstring); rows with
        fewer eligible anchors than the batch's most are padded with slots that ``keep`` marks False."""
        eligible = step_valid_masks(batch, 2)[1]
        scores = torch.rand(eligible.shape, device=eligible.device).masked_fill(~eligible, 2.0)
        order = scores.argsort(-1)  # eligible anchors first, shuffled
        counts = eligible.sum(-1)
        if self.anchors_per_row is not None:
            counts = counts.clamp(max=self.anchors_per_row)
        widths = [math.ceil(int(counts.max()) * share) for share in self.depth_shares]
        anchors, depths, keep = [], [], []
        for d, width in enumerate(widths, start=1):
            if width == 0:
                break
            kept = (
                torch.arange(width, device=order.device)[None]
                < (counts[:, None] * self.depth_shares[d - 1]).ceil()
            )
            anchors.append(order[:, :width].where(kept, 0))
            depths.append(torch.full_like(anchors[-1], d))
            keep.append(kept)
        if not anchors:
            empty = order[:, :0]
            return empty, empty, empty.bool()
        return torch.cat(anchors, 1), torch.cat(depths, 1), torch.cat(keep, 1)

    def slot_teacher(self, batch: Batch, anchors: torch.Tensor, depths: torch.Tensor, keep: torch.Tensor):
        """Per slot: whether it counts [B, S] and the teacher's position t+1+d (clamped into the row)."""
        T = batch.input_ids.shape[1]
        steps = step_valid_masks(batch, len(self.depth_shares) + 1)  # [K, B, T]
        counts = steps[depths, torch.arange(anchors.shape[0], device=anchors.device)[:, None], anchors] & keep
        return counts, (anchors + 1 + depths).clamp(max=T - 1)

    def loss(self, draft: nn.Module, batch: Batch, teacher: Teacher) -> dict[str, torch.Tensor]:
        head = _unwrap(draft)
        anchors, depths, keep = self.sample_slots(batch)
        real_counts = step_valid_masks(batch, 1)[0]  # [B, T]
        slot_counts, slot_pos = self.slot_teacher(batch, anchors, depths, keep)
        counted = torch.cat([real_counts, slot_counts], 1)  # [B, T + S]
        out = draft(batch.input_ids, teacher.features, batch.attention_mask, logit_masks=counted[None],
                    position_ids=batch.position_ids, slots=(anchors, depths, keep))  # fmt: skip
        T = batch.input_ids.shape[1]
        rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None]
        teacher_pos = torch.cat([(torch.arange(T, device=anchors.device) + 1).clamp(max=T - 1).expand_as(real_counts),
                                 slot_pos], 1)  # fmt: skip
        t_ids = teacher.topk_ids[rows, teacher_pos][counted]
        draft_index = head.t2d.long().cumsum(0) - 1  # target id -> draft id (d2t is ascending)
        t_draft = torch.where(head.t2d[t_ids], draft_index[t_ids], -1)
        ce, has_mass = soft_topk_cross_entropy(
            out.logits[0], teacher.topk_logits[rows, teacher_pos][counted], t_draft
        )
        depth = torch.cat([torch.zeros_like(real_counts, dtype=torch.long), depths], 1)[counted]
        greedy = teacher_greedy(teacher)[rows, teacher_pos][counted]
        hits, draftable = head.d2t[out.logits[0].argmax(-1)] == greedy, head.t2d[greedy]
        logs = {"tokens": real_counts.sum().float(), "slots": slot_counts.sum().float()}
        for d in range(
            min(4, len(self.depth_shares) + 1)
        ):  # accuracy where the draft vocabulary can be right
            at = (depth == d) & draftable
            logs[f"acc_{d}"] = hits[at].float().sum() / at.sum().clamp_min(1)
        return {"loss": masked_mean(ce[has_mass]), **logs}

    @torch.no_grad()
    def chain_lengths(
        self, draft: nn.Module, batch: Batch, teacher: Teacher, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B, T], starts [B, T]) for ``decoding_walk``: at each chain start t, the real pair at t and
        the slots of anchor t at depths 1..n-1 drafted in one forward (n = min(k, parallel_depths)); the chain
        accepts its leading tokens that equal the target's greedy ones."""
        starts = chain_starts(batch, k)
        accepted = torch.zeros(starts.shape, dtype=torch.long, device=starts.device)
        n = min(k, self.config.parallel_depths)
        if n < 1 or not starts.any():
            return accepted, starts
        head, greedy, T = _unwrap(draft), teacher_greedy(teacher), starts.shape[1]
        for b in range(starts.shape[0]):
            row = Batch(*(x[b : b + 1] if x is not None else None for x in
                          (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.position_ids)))  # fmt: skip
            feats = {i: teacher.features[i][b : b + 1] for i in self.capture_layers}
            for cols in starts[b].nonzero().flatten().split(VALIDATION_ANCHORS):
                anchors = cols.repeat_interleave(n - 1)[None]
                depths = torch.arange(1, n, device=cols.device).repeat(cols.numel())[None]
                no_logits = torch.zeros(1, 1, T + anchors.shape[1], dtype=torch.bool, device=cols.device)
                out = draft(row.input_ids, feats, row.attention_mask, logit_masks=no_logits,
                            position_ids=row.position_ids,
                            slots=(anchors, depths, torch.ones_like(anchors, dtype=torch.bool)))  # fmt: skip
                hidden = out.hidden_states[0][0]
                H = hidden.shape[-1]
                rows = torch.cat(
                    [hidden[cols][:, None], hidden[T:].view(cols.numel(), n - 1, H)], 1
                )  # [N, n, H]
                drafted = head.d2t[head.draft_logits(rows).argmax(-1)]
                expected = greedy[
                    b, (cols[:, None] + 1 + torch.arange(n, device=cols.device)).clamp(max=T - 1)
                ]
                accepted[b, cols] = (drafted == expected).long().cumprod(-1).sum(-1)
        return accepted, starts


@register_objective(PEAGLE, options=PEagleOptions)
def _build(target, options: dict, token_counts=None) -> PEagleObjective:
    return PEagleObjective(target, PEagleOptions(**options), token_counts)
