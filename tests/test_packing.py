"""Packed rows (several conversations in one row): nothing may leak from one conversation to the next.

Each check packs two conversations into one row and compares with the same conversations as rows of
their own: the target's teacher outputs, the EAGLE head's TTT unroll, its loss masks and the distill
draft's logits must agree position by position.
"""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_target

from draftsmith.drafts.eagle_parts import packed_segments
from draftsmith.train.objective import Batch
from draftsmith.train.objectives.common import step_valid_masks
from draftsmith.train.objectives.eagle import Eagle3Options, EagleObjective
from draftsmith.train.teacher import compute_teacher

LENGTHS = (9, 7)
LAYERS = (1, 3)


def conversations() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]


def packed_batch(convs: list[torch.Tensor], pad: int = 2) -> Batch:
    """One row: the conversations back to back, then ``pad`` padding tokens (position 0, masked)."""
    ids = torch.cat([*convs, torch.zeros(pad, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(len(c)) for c in convs] + [torch.zeros(pad, dtype=torch.long)])[None]
    attn = torch.cat([torch.ones(sum(LENGTHS), dtype=torch.long), torch.zeros(pad, dtype=torch.long)])[None]
    learnt = attn.clone()
    return Batch(ids, attn, learnt, positions)


def single_batch(conv: torch.Tensor) -> Batch:
    ones = torch.ones(1, len(conv), dtype=torch.long)
    return Batch(conv[None], ones, ones.clone())


def spans() -> list[slice]:
    starts = [0, LENGTHS[0]]
    return [slice(s, s + n) for s, n in zip(starts, LENGTHS)]


def test_packed_segments_follow_position_restarts():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 4, 5, 6]])
    expected = torch.tensor([[1, 1, 1, 2, 2, 3, 4], [1, 1, 1, 1, 1, 1, 1]])
    assert torch.equal(packed_segments(positions), expected)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_teacher_does_not_attend_across_packed_conversations(arch):
    target = tiny_target(arch, layers=4)
    convs = conversations()
    packed = compute_teacher(target, packed_batch(convs), LAYERS, topk=8)
    for conv, span in zip(convs, spans()):
        alone = compute_teacher(target, single_batch(conv), LAYERS, topk=8)
        torch.testing.assert_close(packed.topk_logits[0, span], alone.topk_logits[0], atol=1e-4, rtol=1e-4)
        for layer in LAYERS:
            torch.testing.assert_close(
                packed.features[layer][0, span], alone.features[layer][0], atol=1e-4, rtol=1e-4
            )


def test_eagle_unroll_and_masks_match_unpacked_rows():
    target = tiny_target("llama", layers=6)
    objective = EagleObjective(target, Eagle3Options(draft_vocab_size=target.vocab_size, ttt_steps=3))
    head = objective.build_draft().eval()
    convs = conversations()
    batch = packed_batch(convs)
    teacher = compute_teacher(target, batch, objective.capture_layers, topk=8)
    with torch.no_grad():
        packed = head(
            batch.input_ids, teacher.features, batch.attention_mask, steps=3, position_ids=batch.position_ids
        )
    valid = step_valid_masks(batch, 3)
    for conv, span in zip(convs, spans()):
        alone_batch = single_batch(conv)
        alone_teacher = compute_teacher(target, alone_batch, objective.capture_layers, topk=8)
        with torch.no_grad():
            alone = head(conv[None], alone_teacher.features, alone_batch.attention_mask, steps=3)
        alone_valid = step_valid_masks(alone_batch, 3)
        for j in range(3):
            # anchors whose step-j input token is still inside the conversation see the same keys
            inside = slice(span.start, span.stop - 1 - j)
            torch.testing.assert_close(
                packed.hidden_states[j][0, inside],
                alone.hidden_states[j][0, : inside.stop - inside.start],
                atol=1e-4,
                rtol=1e-4,
            )
            assert torch.equal(valid[j, 0, span], alone_valid[j, 0])
    # a valid anchor never reaches into the other conversation or the padding
    assert not valid[:, 0, LENGTHS[0] - 2 : LENGTHS[0]].any()


def test_distill_draft_logits_match_unpacked_rows():
    from draftsmith.train.objectives.distill import DistillObjective, DistillOptions

    target = tiny_target("llama", layers=4)
    objective = DistillObjective(target, DistillOptions(num_layers=2))
    draft = objective.build_draft().eval()
    convs = conversations()
    with torch.no_grad():
        packed = objective._draft_logits(draft, packed_batch(convs))
        for conv, span in zip(convs, spans()):
            alone = objective._draft_logits(draft, single_batch(conv))
            torch.testing.assert_close(packed[0, span.start : span.stop - 1], alone[0], atol=1e-4, rtol=1e-4)
