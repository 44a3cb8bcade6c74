"""Which token each slot of a block drafter is scored against, pinned by the modules' docstrings rather than
by their code: an oracle draft that drafts exactly the token a slot stands in for scores every slot right
and a near-zero loss, and validation accepts its whole chains; the same oracle one token early or late
scores nothing. A label shifted by one in ``train/objectives/{dflash,peagle}.py`` fails here.

The data is a stream of distinct tokens and the teacher is perfect on it (its greedy next token after
position p is token p+1 of the stream), so "the target's next-token distribution at p" and "token p+1"
name the same id, and a shift by one names a different one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_target

from draftsmith.drafts.eagle import EagleOutput
from draftsmith.train.objective import Batch, Teacher
from draftsmith.train.registry import build_objective

T, BLOCK, DEPTHS, K = 20, 5, 4, 4
CONFIDENT = 30.0  # the oracle's logit margin: a right token has probability 1 - 1e-11


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4)


def stream_batch(vocab: int) -> tuple[torch.Tensor, Batch]:
    """Two rows of distinct tokens, the stream running past the row's end (where no label counts); row 1
    ends in padding and has a longer prompt. Returns (stream [2, T + 8], batch)."""
    gen = torch.Generator().manual_seed(0)
    stream = torch.stack([torch.randperm(vocab, generator=gen)[: T + 8] for _ in range(2)])
    real, learnt = torch.ones(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    real[1, 16:] = 0
    learnt[0, 4:], learnt[1, 6:16] = 1, 1
    return stream, Batch(stream[:, :T].clone(), real, learnt)


def perfect_teacher(stream: torch.Tensor, capture_layers, hidden: int, vocab: int) -> Teacher:
    """Top-K whose best id after position p is stream token p+1, by a wide margin."""
    best = stream[:, 1 : T + 1]
    ids = torch.stack([best, *[(best + j) % vocab for j in range(1, K)]], dim=-1)
    logits = torch.tensor([10.0] + [0.0] * (K - 1)).expand(2, T, K).clone()
    return Teacher({i: torch.zeros(2, T, hidden) for i in capture_layers}, logits, ids)


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.one_hot(tokens, vocab).float() * CONFIDENT


def streams_of(stream: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The stream rows [B, T + 8] of the batch's rows (validation runs one row at a time)."""
    return torch.stack([stream[(stream[:, :T] == ids).all(-1)][0] for ids in input_ids])


# ---- DFlash: slot i of the block anchored at a stands in for token a+i --------------------------------


def dflash_oracle(stream: torch.Tensor, vocab: int, shift: int):
    """``block_logits`` of a draft whose slot i (1..Q-1) of the block at anchor a drafts token a+i+shift."""

    def block_logits(draft, batch, teacher, anchors, keep, walk=False):
        at = anchors[..., None] + torch.arange(1, BLOCK) + shift  # [B, N, Q-1]
        tokens = streams_of(stream, batch.input_ids).gather(1, at.flatten(1))
        return one_hot(tokens.view_as(at), vocab)

    return block_logits


@pytest.mark.parametrize("shift", [0, -1, 1])
def test_dflash_slot_i_is_scored_against_token_anchor_plus_i(target, shift):
    objective = build_objective("dflash", target, {"block_size": BLOCK, "anchors_per_row": 64})
    stream, batch = stream_batch(target.vocab_size)
    teacher = perfect_teacher(stream, objective.capture_layers, target.config.hidden_size, target.vocab_size)
    objective.block_logits = dflash_oracle(stream, target.vocab_size, shift)
    torch.manual_seed(0)
    out = objective.loss(None, batch, teacher)
    accuracy = [float(out[f"acc_{i}"]) for i in range(BLOCK - 1)]
    assert float(out["tokens"]) > 0
    if shift == 0:
        assert accuracy == [1.0] * (BLOCK - 1) and float(out["loss"]) < 0.1
    else:
        assert accuracy == [0.0] * (BLOCK - 1) and float(out["loss"]) > 10

    accepted, starts = objective.chain_lengths(None, batch, teacher, k=3)
    assert starts.sum() > 0
    assert accepted[starts].tolist() == [3 if shift == 0 else 0] * int(starts.sum())


# ---- P-EAGLE: the real pair at t stands in for position t+1, the slot at depth d for t+1+d --------------


def peagle_oracle(head, stream: torch.Tensor, vocab: int, shift: int):
    """Make ``head`` draft token t+2+d+shift at anchor t, depth d (depth 0: the real pair): the token the
    target's distribution at t+1+d predicts. Its hidden states are those one-hot logits."""

    def forward(input_ids, features, attention_mask=None, steps=1, logit_masks=None, position_ids=None,
                slots=None):  # fmt: skip
        anchors, depths, _ = slots
        B = input_ids.shape[0]
        t = torch.cat([torch.arange(T).expand(B, T), anchors], 1)
        d = torch.cat([torch.zeros(B, T, dtype=torch.long), depths], 1)
        hidden = one_hot(streams_of(stream, input_ids).gather(1, t + 2 + d + shift), vocab)
        return EagleOutput([hidden], [hidden[logit_masks[0]]])

    head.forward = forward
    head.draft_logits = lambda hidden: hidden
    return head


@pytest.mark.parametrize("shift", [0, -1, 1])
def test_peagle_depth_d_of_anchor_t_is_scored_against_token_t_plus_2_plus_d(target, shift):
    V = target.vocab_size
    objective = build_objective("peagle", target, {"parallel_depths": DEPTHS, "draft_vocab_size": V})
    stream, batch = stream_batch(V)
    teacher = perfect_teacher(stream, objective.capture_layers, target.config.hidden_size, V)
    head = peagle_oracle(objective.build_draft(), stream, V, shift)
    torch.manual_seed(0)
    out = objective.loss(head, batch, teacher)
    accuracy = [float(out[f"acc_{d}"]) for d in range(DEPTHS)]
    assert float(out["tokens"]) > 0 and float(out["slots"]) > 0
    if shift == 0:
        assert accuracy == [1.0] * DEPTHS and float(out["loss"]) < 0.1
    else:
        assert accuracy == [0.0] * DEPTHS and float(out["loss"]) > 10

    accepted, starts = objective.chain_lengths(head, batch, teacher, k=3)
    assert starts.sum() > 0
    assert accepted[starts].tolist() == [3 if shift == 0 else 0] * int(starts.sum())
