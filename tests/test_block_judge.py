"""The held-out judge (bench/heldout_tau.py) scores a block draft by DFlash's own validation walk, whoever saved it:
a DFlash draft with a reduced vocabulary, saved by draftsmith and the same draft in speculators' layout (its head
rows and ``d2t`` offsets, as a peer's DFlash writes them) give the same chains, block for block."""

from __future__ import annotations

import torch
from heldout_tau import block_objective
from tiny import tiny_target

from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts.base import DFLASH, DSPARK, PEER_DFLASH, kind_of_checkpoint
from draftsmith.export import export_checkpoint
from draftsmith.train.corpus.tokens import collate
from draftsmith.train.registry import build_objective
from draftsmith.train.teacher import compute_teacher


def test_the_judge_walks_a_peers_dflash_as_the_same_draft_saved_by_draftsmith(tmp_path):
    target = tiny_target("llama", layers=6)
    V = target.vocab_size
    counts = torch.randperm(
        V, generator=torch.Generator().manual_seed(1)
    ).float()  # the head's rows: not 0..63
    options = {"block_size": 4, "capture_layer_ids": [1, 2, 4], "draft_vocab_size": 64}
    draft = build_objective(DFLASH, target, options, token_counts=counts).build_draft()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
    draft.eval().save_pretrained(tmp_path / "own")
    peer = export_checkpoint(locate_checkpoint(str(tmp_path / "own")), "speculators", tmp_path / "peer")
    assert kind_of_checkpoint(peer).name == PEER_DFLASH

    ids = torch.randint(3, V, (2, 20), generator=gen)
    batch = collate([{"input_ids": row, "loss_mask": torch.ones_like(row)} for row in ids], pad_id=0)
    judged = {}
    for kind, path in ((DFLASH, tmp_path / "own"), (PEER_DFLASH, peer)):
        objective, head = block_objective(kind, str(path), target)
        teacher = compute_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
        anchors = torch.arange(1, 16)[None].expand(2, -1)
        with torch.no_grad():
            logits = objective.block_logits(
                head, batch, teacher, anchors, torch.ones_like(anchors, dtype=torch.bool)
            )
        judged[kind] = (
            objective.d2t[logits.argmax(-1)],
            logits,
            objective.chain_lengths(head, batch, teacher, 3),
        )
    (own_ids, own_logits, own_walk), (peer_ids, peer_logits, peer_walk) = judged[DFLASH], judged[PEER_DFLASH]
    torch.testing.assert_close(peer_logits, own_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(peer_ids, own_ids)
    assert all(torch.equal(a, b) for a, b in zip(peer_walk, own_walk))
    # the map matters: a judge that read the head's rows as the target's first 64 ids would draft other tokens
    assert not torch.equal(own_logits.argmax(-1), own_ids)


def test_the_judge_walks_a_saved_peagle_head_as_its_training_validated_it(tmp_path):
    """A P-EAGLE head with a reduced vocabulary, trained on the target's own continuations, saved and read back by
    the judge, walks exactly as the objective that trained it walks the head in memory (one forward per chain, its
    own vocabulary map), and accepts drafts."""
    from heldout_tau import parallel_objective
    from test_eagle import make_teacher, self_distilled_batch, train

    from draftsmith.drafts.base import PEAGLE

    target = tiny_target("llama", layers=4)
    batch = self_distilled_batch(target)
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    trained = build_objective(PEAGLE, target, {"parallel_depths": 4, "draft_vocab_size": 200}, counts)
    teacher = make_teacher(target, batch, trained.capture_layers, 64)
    head, _, _ = train(trained, batch, teacher, steps=60)
    trained.save(head.eval(), tmp_path / "draft")

    objective, saved = parallel_objective(str(tmp_path / "draft"), target)
    assert objective.capture_layers == trained.capture_layers
    judged = objective.chain_lengths(saved, batch, teacher, 4)
    own = trained.chain_lengths(head, batch, teacher, 4)
    assert all(torch.equal(a, b) for a, b in zip(judged, own)) and int(own[0].sum()) > 0
    # the map matters: read through the target's first 200 ids instead, the chains differ
    saved.d2t.copy_(torch.arange(200))
    assert not torch.equal(objective.chain_lengths(saved, batch, teacher, 4)[0], own[0])


def test_every_block_setting_of_the_bench_names_its_anchors_and_slot_weighting():
    """A recorded setting keeps meaning what it was trained with when a default moves (DFlash's anchors went
    64 -> 512, its slot weighting decay -> D-PACE): every DFlash and DSpark draft of bench/block_drafters.py
    names both."""
    from block_drafters import DRAFTS

    blocks = {name: spec for name, spec in DRAFTS.items() if spec and spec["kind"] in (DFLASH, DSPARK)}
    assert len(blocks) >= 10
    for name, spec in blocks.items():
        assert {"anchors_per_row", "slot_weighting"} <= set(spec["options"]), name
