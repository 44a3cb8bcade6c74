"""DFlash objective: the block drafter of ``drafts/dflash.py`` trained on the target's tapped features.

Anchors. Per row, up to ``anchors_per_row`` positions a are drawn at random among those where token a
and token a+1 are learnt (so a is a token the target produced, as the last committed token is when
decoding drafts a block after it; an answer's first token comes from the prefill and anchors nothing).
All of a row's blocks run in one forward of the draft: block a is ``[token a, MASK × (Q - 1)]`` at
positions a..a+Q-1 and sees the target's features strictly before a in its own conversation (packed
rows hold several) and every slot of itself — exactly what decoding gives it (``DFlashDrafter``).

Loss. Slot i (1..Q-1) of block a stands in for token a+i: it is scored against the target's next-token
distribution at a+i-1 (soft CE on the teacher's top-k, renormalised; the default) or the target's
greedy token there (``hard_labels``), where token a+i is learnt and in a's conversation; slots weigh their
D-PACE weights (the default; arXiv 2605.18810: each slot by the chance, from the draft's own probabilities of
the target's tokens, that decoding reaches it and the slots after), summed over a block's slots and averaged
over blocks, or with ``slot_weighting: decay`` ``exp(-(i-1)/gamma)`` (later slots count only when every earlier
one was accepted), the mean over slots.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from pydantic.dataclasses import dataclass
from torch import nn

from draftsmith.drafts.base import DFLASH
from draftsmith.drafts.dflash import MAX_BLOCK, DFlashConfig, DFlashDraft, block_inputs
from draftsmith.drafts.eagle_parts import build_vocab_map, packed_segments
from draftsmith.train.losses import (
    dpace_weights,
    lk_hybrid,
    soft_topk_cross_entropy,
    teacher_entropy,
    topk_acceptance,
)
from draftsmith.train.objective import Batch, Objective, Teacher, feature_noise
from draftsmith.train.objectives.common import chain_starts, same_conversation, shift_left, teacher_greedy
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION

DEFAULT_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}
"""The paper's position-weight decay per block size; other sizes take block_size / 2."""
VALIDATION_ANCHORS = 128
"""Blocks per forward when validation runs a block at every chain start of a row."""


@dataclass(config=SECTION)
class DFlashOptions:
    """``draft.options`` of ``dflash``: the one declaration of each (default, range, help), which
    ``DFlashObjective`` receives whole."""

    num_layers: Annotated[int, Field(ge=1)] = 1
    """Draft decoder layers (Qwen3-style, at the target's hidden size)."""
    block_size: Annotated[int, Field(ge=2, le=MAX_BLOCK)] = 8
    """Block size Q: one forward drafts the Q - 1 tokens after the last committed one, so at least 2 (the
    last token and one slot to draft; the paper: 8 or 16)."""
    capture_layer_ids: list[int] | None = None
    """Target layers read, strictly increasing (the last only if served by vLLM: SGLang and llama.cpp cannot
    capture it); default: EAGLE-3's low / middle / high."""
    mask_token_id: int | None = None
    """The token embedded at the slots to draft (default: the tokenizer's mask, unknown or padding token)."""
    draft_vocab_size: Annotated[int, Field(ge=1)] | None = None
    """Score only the training data's most frequent tokens with a head of the draft's own (default: the
    target's vocabulary with the target's LM head; on a CPU the LM head is most of a block's cost)."""
    anchors_per_row: Annotated[int, Field(ge=1)] = 512
    """Blocks trained per row and step, at anchors drawn where two learnt tokens follow each other (default:
    every one of a 512-token row, as the peers draw up to 512 a sequence; at 0.4M tokens held-out τ 1.627 ±
    0.005 against 1.531 at 64, for about twice the step time on a CPU: BENCHMARKS.md, block drafters)."""
    gamma: Annotated[float, Field(gt=0)] | None = None
    """With slot_weighting decay, slot i's loss weighs exp(-(i-1)/gamma) (default: 4 / 5 / 7 for blocks of 8 / 10 /
    16, else Q / 2)."""
    slot_weighting: Literal["decay", "dpace"] = "dpace"
    """How a block's slots are weighed: dpace (D-PACE, arXiv 2605.18810: slot i by the chance decoding reaches it
    and the slots after, from the draft's own probability of the target's token at each slot; summed over a
    block's slots, averaged over blocks; gamma unused; the default: at 0.4M tokens held-out τ 1.691 ± 0.001 (3
    seeds) against 1.627 ± 0.005 with decay, dev τ 1.295 against 1.230: BENCHMARKS.md, block drafters) or decay
    (gamma's, a weighted mean)."""
    dpace_alpha: Annotated[float, Field(gt=0, le=1)] = 0.5
    """D-PACE's floor α of a slot's chance (slot_weighting: dpace): q̃ = (1 - α)·q + α; at 1 every valid slot
    counts fully (slot i weighs the valid slots from i on)."""
    hard_labels: bool = False
    """Cross-entropy on the target's greedy token instead of its top-k distribution."""
    teacher_topk: Annotated[int, Field(ge=1)] = 64
    """The target's largest logits per position the soft targets are made of."""
    loss: Literal["kl", "lk_hybrid"] = "kl"
    """Per-slot loss against the target's top-k: kl (the soft cross-entropy), lk_hybrid (LK^λ, arXiv 2602.23881:
    λ·KL + (1 - λ)·(1 - acceptance), λ = exp(-3·acceptance), as EAGLE's option: KL's gradient while the draft is far
    from the target, a block drafter's cold start; not with hard_labels)."""
    feature_noise: Annotated[float, Field(ge=0)] = 0.0
    """Uniform noise in [-feature_noise, feature_noise] added to the target's tapped features in training steps
    only (validation's walk reads them untouched), as EAGLE's option of the same name (speculators 0.05)."""

    def __post_init__(self):
        if self.hard_labels and self.loss != "kl":
            raise ValueError(
                f"loss {self.loss!r} scores the target's top-k distribution and hard_labels its greedy token alone: "
                "set one of them"
            )


class DFlashObjective(Objective):
    """DFlash draft + position-weighted (soft or hard) cross-entropy; see the module docstring."""

    kind = DFLASH

    def __init__(
        self, target, options: DFlashOptions | None = None, token_counts: torch.Tensor | None = None
    ):
        """``options``: the kind's ``draft.options``, checked and filled in by its class (``DFlashOptions``:
        each option's default, range and meaning, as ``train --help`` shows them); ``token_counts``: the
        training data's token counts over the target's vocabulary (a reduced draft vocabulary needs them)."""
        o = DFlashOptions() if options is None else options
        self.options = o
        self.target = target
        self.config = DFlashConfig.for_target(
            target, o.num_layers, o.block_size, o.capture_layer_ids, o.mask_token_id, o.draft_vocab_size
        )
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        d2t, t2d = torch.arange(V), torch.ones(V, dtype=torch.bool)
        if Vd < V:
            if token_counts is None or token_counts.numel() != V:
                raise ValueError(
                    f"draft.options.draft_vocab_size {Vd} < the target's {V} needs the training data's token counts "
                    "over the target's vocabulary (`draftsmith train` counts them)"
                )
            d2t, t2d = build_vocab_map(token_counts, Vd)
        self.token_counts = token_counts
        self.d2t = d2t
        self.draft_index = torch.where(t2d, t2d.long().cumsum(0) - 1, -1)  # target id -> draft id, -1 outside
        self.capture_layers = tuple(self.config.capture_layer_ids)
        self.anchors_per_row = o.anchors_per_row
        block = self.config.block_size
        gamma = DEFAULT_GAMMA.get(block, block / 2) if o.gamma is None else o.gamma
        self.slot_weights = [math.exp(-i / gamma) for i in range(block - 1)]
        self.slot_weighting, self.dpace_alpha = o.slot_weighting, o.dpace_alpha
        self.hard_labels, self.loss_name = o.hard_labels, o.loss
        self.feature_noise = o.feature_noise
        self.teacher_topk = 1 if self.hard_labels else o.teacher_topk
        model = target.model
        self.embed_weight = model.get_input_embeddings().weight  # the target's, shared: never copied
        self.lm_head = model.get_output_embeddings()

    def build_draft(self) -> DFlashDraft:
        draft = DFlashDraft(DFlashConfig.from_dict(self.config.to_dict()))
        draft.init_from_target(self.target.model, self.token_counts)
        return draft

    def block_logits(self, draft: nn.Module, batch: Batch, teacher: Teacher, anchors: torch.Tensor,
                     keep: torch.Tensor, walk: bool = False) -> torch.Tensor:  # fmt: skip
        """Logits [B, N, Q - 1, Vd] (the draft vocabulary) of the blocks at ``anchors`` [B, N] (``keep`` marks real
        ones); ``walk``: for validation's decoding walk, where what precedes a slot is the target's greedy
        continuation rather than the row (``slot_inputs``)."""
        real = batch.attention_mask.bool()
        T = real.shape[1]
        positions = (
            batch.position_ids
            if batch.position_ids is not None
            else (real.long().cumsum(-1) - 1).clamp_min(0)
        )
        tokens = batch.input_ids.gather(1, anchors)
        ids, block_positions = block_inputs(
            tokens, positions.gather(1, anchors), self.config.block_size, self.config.mask_token_id
        )
        segments = (
            packed_segments(positions) if batch.position_ids is not None else torch.zeros_like(positions)
        )
        columns = torch.arange(T, device=anchors.device)
        context_mask = (
            (columns[None, None, :] < anchors[..., None])
            & (segments[:, None, :] == segments.gather(1, anchors)[..., None])
            & real[:, None, :]
            & keep[..., None]
        )
        features = {i: teacher.features[i] for i in self.capture_layers}
        if draft.training and not walk:
            features = feature_noise(features, self.feature_noise)
        return draft(F.embedding(ids, self.embed_weight), block_positions, context_mask, features=features,
                     feature_positions=positions, target_head=self.lm_head,
                     **self.slot_inputs(batch, teacher, anchors, walk))  # fmt: skip

    def slot_inputs(self, batch: Batch, teacher: Teacher, anchors: torch.Tensor, walk: bool = False
                    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """What the draft's forward takes per slot besides the block (a kind built on DFlash adds its own;
        ``walk``: as ``block_logits``)."""
        return {}

    def slot_labels(self, batch: Batch, teacher: Teacher, anchors: torch.Tensor, keep: torch.Tensor):
        """Per slot i of each block: where it counts [B, N, Q - 1] and the teacher's index (row, position a+i-1)."""
        B, T = batch.input_ids.shape
        offsets = torch.arange(1, self.config.block_size, device=anchors.device)
        label_pos = anchors[..., None] + offsets  # token a+i
        inside = label_pos < T
        label_pos = label_pos.clamp(max=T - 1)
        learnt = (
            (batch.loss_mask.bool() & batch.attention_mask.bool())
            .gather(1, label_pos.view(B, -1))
            .view_as(label_pos)
        )
        if batch.position_ids is None:
            same = torch.ones_like(inside)
        else:
            segments = packed_segments(batch.position_ids)
            same = (
                segments.gather(1, label_pos.view(B, -1)).view_as(label_pos)
                == segments.gather(1, anchors)[..., None]
            )
        counts = keep[..., None] & inside & learnt & same
        return counts, label_pos - 1

    def sample_anchors(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``anchors_per_row`` anchors per row [B, N] drawn where tokens a and a+1 are learnt (and
        in one conversation), and which of them are real [B, N] (a row with fewer has padding)."""
        learnt = batch.loss_mask.bool() & batch.attention_mask.bool()
        valid = learnt & shift_left(learnt, 1) & same_conversation(batch, 1)
        n = max(1, min(self.anchors_per_row, int(valid.sum(-1).max())))
        scores = torch.rand(valid.shape, device=valid.device).masked_fill(~valid, 2.0)
        anchors = scores.argsort(-1)[:, :n]
        keep = valid.gather(1, anchors)
        return anchors.where(keep, torch.zeros_like(anchors)), keep

    def loss(self, draft: nn.Module, batch: Batch, teacher: Teacher) -> dict[str, torch.Tensor]:
        anchors, keep = self.sample_anchors(batch)
        counts, teacher_pos = self.slot_labels(batch, teacher, anchors, keep)
        logits = self.block_logits(draft, batch, teacher, anchors, keep)  # [B, N, Q-1, Vd]
        d2t, draft_index = self.d2t.to(logits.device), self.draft_index.to(logits.device)
        B = anchors.shape[0]
        rows = torch.arange(B, device=anchors.device)[:, None, None].expand_as(teacher_pos)
        greedy = teacher_greedy(teacher)[rows, teacher_pos]
        selected = logits[counts].float()
        if self.hard_labels:  # a greedy token outside the draft vocabulary cannot be drafted: left out
            labels = draft_index[greedy[counts]]
            ce, has_mass = F.cross_entropy(selected, labels.clamp_min(0), reduction="none"), labels >= 0
        else:
            t_logits = teacher.topk_logits[rows, teacher_pos][counts]
            t_draft = draft_index[teacher.topk_ids[rows, teacher_pos][counts]]
            ce, has_mass = soft_topk_cross_entropy(selected, t_logits, t_draft)
            if self.loss_name == "lk_hybrid":
                acceptance = topk_acceptance(selected, t_logits, t_draft)
                ce = torch.where(
                    has_mass, lk_hybrid(ce - teacher_entropy(t_logits, t_draft), acceptance), 0.0
                )
        hits = (d2t[logits.argmax(-1)] == greedy) & counts
        logs = {"tokens": counts[..., 0].sum().float()}
        if self.slot_weighting == "dpace":
            losses = counts.new_zeros(counts.shape, dtype=torch.float32)
            losses[counts] = torch.where(has_mass, ce, 0.0).float()
            labels = draft_index[
                greedy
            ]  # the draft's probability of the target's token, 0 outside its vocabulary
            chances = logits.detach().float().softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
            chances = torch.where(counts & (labels >= 0), chances, 0.0)
            slots_first = (2, 0, 1)  # dpace_weights runs along the first dimension: the slots
            weights = dpace_weights(
                chances.permute(slots_first), counts.permute(slots_first), self.dpace_alpha
            )
            weights = weights.permute(1, 2, 0)
            total = (weights * losses).sum() / counts[..., 0].sum().clamp_min(1)
            for i in range(min(4, counts.shape[-1])):
                logs[f"weight_{i}"] = weights[..., i][counts[..., i]].mean().nan_to_num(0.0)
        else:
            weights = torch.tensor(self.slot_weights, device=ce.device).expand_as(counts)[counts] * has_mass
            total = (weights * ce).sum() / weights.sum().clamp_min(1e-9)
        for i in range(min(4, counts.shape[-1])):
            logs[f"acc_{i}"] = hits[..., i].sum().float() / counts[..., i].sum().clamp_min(1)
        return {"loss": total, **logs}

    @torch.no_grad()
    def chain_lengths(
        self, draft: nn.Module, batch: Batch, teacher: Teacher, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B, T], starts [B, T]) for ``decoding_walk``: a chain starting after t is the block
        anchored at t+1; it accepts its leading slots whose argmax equals the target's greedy token."""
        starts = chain_starts(batch, k)
        accepted = torch.zeros(starts.shape, dtype=torch.long, device=starts.device)
        n = min(k, self.config.block_size - 1)
        if n < 1 or not starts.any():
            return accepted, starts
        greedy = teacher_greedy(teacher)
        for b in range(starts.shape[0]):
            (cols,) = starts[b].nonzero(as_tuple=True)
            row = Batch(*(x[b : b + 1] if x is not None else None for x in
                          (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.position_ids)))  # fmt: skip
            feats = Teacher({i: teacher.features[i][b : b + 1] for i in self.capture_layers},
                            *(x[b : b + 1] if x is not None else None for x in (teacher.topk_logits, teacher.topk_ids)))  # fmt: skip
            for c in cols.split(VALIDATION_ANCHORS):
                anchors = (c + 1)[None]  # the block after start t is anchored on token t+1
                logits = self.block_logits(
                    draft, row, feats, anchors, torch.ones_like(anchors, dtype=torch.bool), walk=True
                )
                expected = torch.stack([greedy[b, c + 1 + j] for j in range(n)], dim=-1)  # target's t+2+j
                matches = self.d2t.to(logits.device)[logits[0, :, :n].argmax(-1)] == expected
                accepted[b, c] = matches.long().cumprod(-1).sum(-1)
        return accepted, starts


@register_objective(DFLASH, options=DFlashOptions)
def _build(target, options: dict, token_counts=None) -> DFlashObjective:
    return DFlashObjective(target, DFlashOptions(**options), token_counts)
