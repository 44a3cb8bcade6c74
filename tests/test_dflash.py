"""DFlash block drafters (drafts/dflash.py, train/objectives/dflash.py) on tiny random targets."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from test_eagle import make_teacher, self_distilled_batch, train
from test_verify import verify_resampling_from_p
from tiny import tiny_target, train_debug_recipe

import draftsmith.decode.speculative as speculative
from draftsmith.decode.sampling import Sampling, to_probs
from draftsmith.decode.speculative import generate
from draftsmith.drafts.base import build_drafter
from draftsmith.drafts.dflash import DFlashConfig, DFlashDraft, DFlashDrafter
from draftsmith.train.objective import Batch, Objective, Teacher, decoding_walk_steps
from draftsmith.train.registry import build_objective, check_objective_options

ARCHS = ["llama", "qwen3", "gemma2"]


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param, layers=4)


def trained(target, block_size: int, steps: int = 40, **options):
    """A draft trained on the target's own greedy continuations (so decoding accepts some of its blocks); the
    fixed slot decay these decoding tests were sized with, unless ``options`` say otherwise."""
    batch = self_distilled_batch(target)
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    options = {"block_size": block_size, "anchors_per_row": 16, "slot_weighting": "decay", **options}
    objective = build_objective("dflash", target, options, counts)
    teacher = make_teacher(target, batch, objective.capture_layers, 64)
    draft, losses, logs = train(objective, batch, teacher, steps=steps)
    return objective, draft, batch, teacher, losses, logs


def walk_along_row(objective, draft, batch: Batch, teacher: Teacher, k: int, row: int = 0) -> list[int]:
    """The accepted lengths of the verify steps greedy k-chain decoding takes along ``batch``'s row, as
    validation simulates them from the teacher (``decoding_walk_steps``)."""
    return decoding_walk_steps(*objective.chain_lengths(draft, batch, teacher, k))[row]


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_greedy_output_is_the_targets_and_trained_blocks_are_accepted(target, block_size):
    objective, draft, batch, teacher, losses, logs = trained(target, block_size)
    assert losses[-1] < 0.8 * losses[0] and {"acc_0", "tokens"} <= set(logs)
    drafter = DFlashDrafter(draft, target.model)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=24).tokens
    for k in (block_size - 1, 2, block_size + 3, "auto"):
        result = generate(target, prompt, drafter, k, 24)
        assert result.tokens == reference, k
        assert max(result.proposed, default=0) <= block_size - 1  # a block drafts block_size - 1 at most
    # Decoding accepts, step by step, what validation's walk along this very continuation predicts (the τ
    # training reports), and more than an untrained draft. A label shift is tests/test_label_alignment.py's:
    # on a continuation this repetitive a head trained one token off is accepted about as often.
    chains = generate(target, prompt, drafter, 2, 24).accepted
    walk = walk_along_row(objective, draft, batch, teacher, 2)
    assert len(walk) >= 5 and chains[: len(walk)] == walk
    untrained = generate(target, prompt, DFlashDrafter(objective.build_draft().eval(), target.model), 2, 24)
    assert untrained.tokens == reference and sum(walk) > sum(untrained.accepted)


def test_an_end_of_sequence_inside_a_block_ends_the_output_where_the_target_does(target):
    _, draft, batch, _, _, _ = trained(target, 8)
    drafter = DFlashDrafter(draft, target.model)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=24).tokens
    saved = target.eos_ids
    try:
        for cut in (3, 9):
            target.eos_ids = {reference[cut]}
            expected = generate(target, prompt, None, max_new_tokens=24)
            result = generate(target, prompt, drafter, 7, 24)
            assert result.tokens == expected.tokens and result.stopped_by == expected.stopped_by == "eos"
    finally:
        target.eos_ids = saved


def test_training_logits_for_an_anchor_equal_the_decoders(target):
    objective, draft, batch, teacher, _, _ = trained(target, 8, steps=5)
    row = Batch(batch.input_ids[:1], batch.attention_mask[:1], batch.loss_mask[:1])
    teacher = Teacher({i: f[:1] for i, f in teacher.features.items()})
    for anchor in (6, 11):
        anchors = torch.tensor([[anchor]])
        train_logits = objective.block_logits(
            draft, row, teacher, anchors, torch.ones_like(anchors, dtype=torch.bool)
        )
        drafter = DFlashDrafter(draft, target.model)
        with torch.no_grad():
            drafter.begin(
                row.input_ids[0, :anchor],
                {i: teacher.features[i][0, :anchor] for i in drafter.capture_layers},
            )
            decode_logits = drafter.block_logits(int(row.input_ids[0, anchor]), anchor)
        torch.testing.assert_close(train_logits[0, 0].float(), decode_logits, rtol=1e-5, atol=1e-5)


def test_packed_rows_see_only_their_own_conversation(target):
    """A block in the second conversation of a packed row gives the logits it gives in a row of its own."""
    objective, draft, batch, _, _, _ = trained(target, 4, steps=3)
    a, b = batch.input_ids[0, :14], batch.input_ids[1, :12]
    packed = torch.cat([a, b])[None]
    positions = torch.cat([torch.arange(14), torch.arange(12)])[None]
    ones = torch.ones_like(packed)
    alone = Batch(b[None], torch.ones_like(b[None]), torch.ones_like(b[None]))
    layers = objective.capture_layers
    with torch.no_grad():
        t_packed = make_teacher(target, Batch(packed, ones, ones), layers, 4)
        t_alone = make_teacher(target, alone, layers, 4)
    for i in layers:  # the packed teacher's second half: the second conversation's own features
        t_packed.features[i][0, 14:] = t_alone.features[i][0]
    got = objective.block_logits(draft, Batch(packed, ones, ones, positions), t_packed, torch.tensor([[14 + 7]]),
                                 torch.tensor([[True]]))  # fmt: skip
    want = objective.block_logits(draft, alone, t_alone, torch.tensor([[7]]), torch.tensor([[True]]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_draft_vocabulary_of_its_own_drafts_target_ids_and_stays_lossless(target):
    objective, draft, batch, teacher, losses, _ = trained(target, 8, draft_vocab_size=120)
    assert draft.has_own_head and draft.lm_head.weight.shape == (120, target.config.hidden_size)
    assert losses[-1] < 0.8 * losses[0]
    drafter = DFlashDrafter(draft, target.model)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=24).tokens
    result = generate(target, prompt, drafter, 7, 24)
    assert result.tokens == reference
    # the decoder maps draft ids to target ids as training scores them: it accepts what validation's walk does
    chains = generate(target, prompt, drafter, 2, 24).accepted
    walk = walk_along_row(objective, draft, batch, teacher, 2)
    assert len(walk) >= 5 and chains[: len(walk)] == walk and sum(walk) > 0
    committed = torch.cat([prompt, torch.tensor(reference[:1])])
    target.set_capture(drafter.capture_layers)
    target.reset()
    drafter.begin(prompt, target.forward(prompt).features)
    proposal = drafter.propose(committed, 7, SAMPLING, torch.Generator().manual_seed(0))
    assert proposal.probs.shape == (7, target.vocab_size)  # over the target's vocabulary, for the verify rule
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[draft.d2t] = False
    assert float(proposal.probs[:, outside].sum()) == 0 and bool(draft.t2d[proposal.tokens].all())
    target.set_capture(())
    with pytest.raises(ValueError, match="draft_vocab_size 120 < the target's 259 needs the training data's"):
        build_objective("dflash", target, {"draft_vocab_size": 120})


# ---- sampling: the committed tokens keep the target's distribution ----------------------------------

LENGTH, SAMPLES, BOUND = 3, 1500, 4.5
SAMPLING = Sampling(temperature=4.0, top_k=3)  # the tiny target's logits are sharpened x20


def exact_distribution(target, prompt) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) of the target alone under SAMPLING, enumerated over the top-k supports."""
    frontier = [((), 1.0)]
    for _ in range(LENGTH):
        grown = []
        for seq, p in frontier:
            target.reset()
            dist = to_probs(target.forward(torch.tensor(prompt.tolist() + list(seq))).logits[-1], SAMPLING)
            grown += [((*seq, tok), p * float(dist[tok])) for tok in dist.nonzero().view(-1).tolist()]
        frontier = grown
    return dict(frontier)


def max_normalised_deviation(target, drafter, prompt, exact) -> tuple[float, int]:
    g = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for _ in range(SAMPLES):
        result = generate(target, prompt, drafter, 3, LENGTH, SAMPLING, g)
        seq = tuple(result.tokens[:LENGTH])
        counts[seq] = counts.get(seq, 0) + 1
        accepted += sum(result.accepted)
    if set(counts) - set(exact):
        return math.inf, accepted
    worst = max(
        abs(counts.get(s, 0) / SAMPLES - p) / math.sqrt(p * (1 - p) / SAMPLES) for s, p in exact.items()
    )
    return worst, accepted


def sampled_continuations() -> tuple:
    """The tiny Llama target (no end of sequence: every sample is LENGTH tokens long), a prompt, and a batch of
    the target's greedy continuation after each first token it can sample there (the rows a draft for the
    sampling tests is trained on)."""
    target = tiny_target("llama", layers=4)
    target.eos_ids = set()
    prompt = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(1))
    target.reset()
    firsts = to_probs(target.forward(prompt).logits[-1], SAMPLING).nonzero().view(-1).tolist()
    rows = []
    for first in firsts:
        start = torch.cat([prompt, torch.tensor([first])])
        rows.append(torch.cat([start, torch.tensor(generate(target, start, None, max_new_tokens=8).tokens)]))
    ids = torch.stack(rows)
    learnt = torch.zeros_like(ids)
    learnt[:, len(prompt) :] = 1
    return target, prompt, Batch(ids, torch.ones_like(ids), learnt)


@pytest.fixture(scope="module")
def sampling_setup():
    """A draft trained briefly on each continuation the target can sample after the prompt: its blocks overlap
    the target's top-k without matching it, so drafts are accepted and rejected, and a wrong residual shows."""
    target, prompt, batch = sampled_continuations()
    objective = build_objective("dflash", target, {"block_size": 4, "slot_weighting": "decay"})  # as sized
    draft, _, _ = train(objective, batch, make_teacher(target, batch, objective.capture_layers, 64), steps=15)
    return target, DFlashDrafter(draft, target.model), prompt, exact_distribution(target, prompt)


def test_sampled_dflash_decoding_keeps_the_target_distribution(sampling_setup):
    target, drafter, prompt, exact = sampling_setup
    worst, accepted = max_normalised_deviation(target, drafter, prompt, exact)
    assert accepted > SAMPLES // 20 and worst < BOUND  # drafts were accepted, and the law is the target's


def test_a_broken_rule_fails_the_same_test(sampling_setup, monkeypatch):
    target, drafter, prompt, exact = sampling_setup
    monkeypatch.setattr(speculative, "verify_sampled", verify_resampling_from_p)
    worst, _ = max_normalised_deviation(target, drafter, prompt, exact)
    assert worst > BOUND


def test_sampled_proposals_carry_their_distributions(target):
    drafter = DFlashDrafter(
        build_objective("dflash", target, {"block_size": 4}).build_draft().eval(), target.model
    )
    prompt = torch.randint(0, 256, (7,))
    target.set_capture(drafter.capture_layers)
    target.reset()
    drafter.begin(prompt, target.forward(prompt).features)
    committed = torch.cat([prompt, prompt[-1:]])  # the prefill's token has no features yet
    proposal = drafter.propose(committed, 5, SAMPLING, torch.Generator().manual_seed(0))
    assert proposal.probs.shape == (3, target.vocab_size)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3))
    assert bool((proposal.probs[torch.arange(3), proposal.tokens] > 0).all())
    target.set_capture(())
    with pytest.raises(ValueError, match="needs the target's features"):
        drafter.begin(prompt, None)


def test_dpace_slot_weighting_trains_and_weighs_slots_by_how_far_decoding_reaches(target):
    """slot_weighting dpace trains a block drafter (finite, falling loss); its weights put the most on slot 1 and
    never grow along the block; at dpace_alpha 1 slot i of a block weighs its counted slots from i on (Q - 1 - i
    where all count), which a rule that dropped D-PACE's suffix sum (weights = the chance alone) would not give."""
    objective, draft, batch, teacher, losses, logs = trained(target, 8, steps=12, slot_weighting="dpace")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.9 * losses[0]
    w = [float(logs[f"weight_{i}"]) for i in range(4)]
    assert w[0] >= w[1] >= w[2] >= w[3] > 0, w
    counts = build_objective("dflash", target, {"block_size": 8, "anchors_per_row": 16, "slot_weighting": "dpace",
                                                "dpace_alpha": 1.0}, objective.token_counts)  # fmt: skip
    torch.manual_seed(0)
    out = counts.loss(draft, batch, teacher)
    torch.manual_seed(0)
    anchors, keep = counts.sample_anchors(batch)
    valid = counts.slot_labels(batch, teacher, anchors, keep)[0].long()
    reach = valid.flip(-1).cumsum(-1).flip(-1)  # counted slots m >= i of each block
    expected = [float(reach[..., i][valid[..., i].bool()].float().mean()) for i in range(4)]
    assert [float(out[f"weight_{i}"]) for i in range(4)] == pytest.approx(expected)
    assert expected[0] > 5.0  # most blocks count all 7 slots


def test_by_default_every_anchor_of_a_full_row_trains_a_block():
    """DFlash's default draws every valid anchor of a 512-token row, as the peers do (up to 512 a sequence);
    the 64 it drew before starved the draft (held-out τ 1.53 against 1.63 at 0.4M tokens)."""
    target = tiny_target("llama", layers=2)
    objective = build_objective("dflash", target, {"block_size": 4})
    ids = torch.randint(3, target.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :12] = 0  # a prompt: its tokens anchor nothing
    batch = Batch(ids, torch.ones_like(ids), loss_mask)
    anchors, keep = objective.sample_anchors(batch)
    assert int(keep.sum()) == 512 - 12 - 1  # every learnt token followed by a learnt one
    assert sorted(anchors[keep].tolist()) == list(range(12, 511))


def test_by_default_a_block_weighs_its_slots_by_dpace_on_dflash_and_dspark_alike():
    """D-PACE slot weights are the default of both block kinds: at 0.4M tokens DFlash's held-out τ 1.69 against
    1.63 with the fixed decay (dev τ 1.30 against 1.23), DSpark's 1.779 ± 0.013 against 1.718 ± 0.010, 3 seeds each."""
    target = tiny_target("llama", layers=2)
    dflash = build_objective("dflash", target, {"block_size": 4})
    dspark = build_objective("dspark", target, {"block_size": 4, "markov_rank": 4})
    assert (dflash.slot_weighting, dspark.slot_weighting) == ("dpace", "dpace")


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_feature_noise_moves_a_blocks_features_in_training_steps_only(kind):
    """``feature_noise`` a on a block kind: the training loss reads the tapped features moved by uniform noise (a
    loss unlike the noiseless one's, the features it reads within a of the target's), while validation's walk and
    the draft in eval mode read them untouched; a negative a is refused by name."""
    target = tiny_target("llama", layers=4)
    batch = self_distilled_batch(target)
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    extra = {"markov_rank": 4} if kind == "dspark" else {}
    noisy = build_objective(
        kind, target, {"block_size": 4, "anchors_per_row": 16, "feature_noise": 0.05, **extra}, counts
    )
    plain = build_objective(kind, target, {"block_size": 4, "anchors_per_row": 16, **extra}, counts)
    teacher = make_teacher(target, batch, noisy.capture_layers, 64)
    torch.manual_seed(0)
    draft = noisy.build_draft()
    seen = []
    forward = draft.forward
    draft.forward = lambda *a, **kw: seen.append(kw["features"]) or forward(*a, **kw)
    draft.train()
    with torch.no_grad():
        torch.manual_seed(1)
        a = noisy.loss(draft, batch, teacher)["loss"]
        torch.manual_seed(1)  # the same anchors
        b = plain.loss(draft, batch, teacher)["loss"]
        assert not torch.equal(a, b)
        moved = max(float((seen[0][i] - teacher.features[i]).abs().max()) for i in noisy.capture_layers)
        assert 0.025 < moved <= 0.05 + 1e-6 and all(
            seen[1][i] is teacher.features[i] for i in plain.capture_layers
        )
        seen.clear()
        noisy.chain_lengths(draft, batch, teacher, 3)  # validation's walk, the draft still in training mode
        rows = range(batch.input_ids.shape[0])
        assert seen and all(any(torch.equal(f[i], teacher.features[i][r : r + 1]) for r in rows)
                            for f in seen for i in noisy.capture_layers)  # fmt: skip
        draft.eval()
        torch.manual_seed(1)
        c = noisy.loss(draft, batch, teacher)["loss"]
        torch.manual_seed(1)
        assert torch.equal(c, plain.loss(draft, batch, teacher)["loss"])
    with pytest.raises(ValueError, match="feature_noise"):
        check_objective_options(kind, {"feature_noise": -0.1})


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_the_lk_loss_of_a_block_is_kl_and_acceptance_mixed_per_slot_and_trains_from_cold(kind):
    """``loss: lk_hybrid`` on a block kind: with the fixed decay, the loss is the decay-weighted mean over slots of
    λ·KL(p || q) + (1 - λ)·(1 - Σ min(p, q)), λ = exp(-3·Σ min(p, q)), computed here by hand from the block's
    logits and the teacher's top-k; it trains a draft from its start (finite, falling); with hard_labels it is
    refused at config time naming both options."""
    target = tiny_target("llama", layers=4)
    batch = self_distilled_batch(target)
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    extra = {"markov_rank": 4} if kind == "dspark" else {}
    options = {
        "block_size": 4,
        "anchors_per_row": 16,
        "slot_weighting": "decay",
        "loss": "lk_hybrid",
        **extra,
    }
    objective = build_objective(kind, target, options, counts)
    teacher = make_teacher(target, batch, objective.capture_layers, 64)
    torch.manual_seed(0)
    draft = objective.build_draft().eval()
    with torch.no_grad():
        torch.manual_seed(1)
        got = objective.loss(draft, batch, teacher)["loss"]
        torch.manual_seed(1)  # the same anchors, by hand
        anchors, keep = objective.sample_anchors(batch)
        where, pos = objective.slot_labels(batch, teacher, anchors, keep)
        logits = objective.block_logits(draft, batch, teacher, anchors, keep)
    total = weights = 0.0
    for b, n, i in where.nonzero().tolist():
        ids = objective.draft_index[teacher.topk_ids[b, pos[b, n, i]]]
        p = teacher.topk_logits[b, pos[b, n, i]].float().masked_fill(ids < 0, -math.inf).softmax(-1)
        log_q = logits[b, n, i].float().log_softmax(-1)[ids.clamp_min(0)]
        inside = ids >= 0
        kl = float((p[inside] * (p[inside].log() - log_q[inside])).sum())
        alpha = float(torch.minimum(p[inside], log_q[inside].exp()).sum())
        lam = math.exp(-3 * alpha)
        total += objective.slot_weights[i] * (lam * kl + (1 - lam) * (1 - alpha))
        weights += objective.slot_weights[i]
    assert float(got) == pytest.approx(total / weights, rel=1e-4)
    _, losses, _ = train(objective, batch, teacher, steps=12)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.9 * losses[0]
    with pytest.raises(ValueError, match="loss 'lk_hybrid' scores the target's top-k .* hard_labels"):
        check_objective_options(kind, {**options, "hard_labels": True})  # at config time, before any target


# ---- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match", "needs_target"),
    [
        ({"block_size": 1}, "block_size must be >= 2, got 1", False),  # the range train --help shows
        ({"block_size": 65}, "block_size must be <= 64, got 65", False),
        ({"mask_token_id": 259}, "mask_token_id 259 is not a token of the target's vocabulary", True),
        ({"mask_token_id": -1}, "mask_token_id -1", True),
        ({"capture_layer_ids": [2, 0]}, "must be strictly increasing.*write them as \\[0, 2\\]", True),
        ({"capture_layer_ids": [0, 9]}, "\\[9\\] outside 0..3", True),
        ({"anchors_per_row": 0}, "anchors_per_row must be >= 1", False),
        ({"slot_weighting": "dpac"}, "slot_weighting", False),
        ({"dpace_alpha": 0}, "dpace_alpha", False),
        ({"blok_size": 8}, "Did you mean 'block_size'", False),
    ],
)
def test_bad_options_are_refused_naming_what_and_why(options, match, needs_target):
    assert_refused("dflash", options, match, needs_target)


def assert_refused(kind: str, options: dict, match: str, needs_target: bool) -> None:
    """Refused by the options check (``train --help``'s ranges) unless it takes the target to know, and
    always when the objective is built: one call per ``pytest.raises``."""
    if not needs_target:
        with pytest.raises(ValueError, match=match):
            check_objective_options(kind, options)
    with pytest.raises(ValueError, match=match):
        build_objective(kind, tiny_target("llama", layers=4), options)


def test_a_draft_for_another_target_is_refused(tmp_path):
    llama = tiny_target("llama", layers=4)
    DFlashDraft(DFlashConfig.for_target(llama, block_size=4)).save_pretrained(tmp_path / "d")
    assert isinstance(build_drafter(str(tmp_path / "d"), llama), DFlashDrafter)
    with pytest.raises(ValueError, match="DFlash draft was trained for target .* hidden_size differs"):
        build_drafter(str(tmp_path / "d"), tiny_target("llama", layers=4, hidden=48))


def test_trains_in_the_loop_and_loads_as_a_drafter(tmp_path):
    """The debug recipe through the one loop on a tiny saved target; the run loads as a DFlash drafter."""
    train_debug_recipe(tmp_path, "debug_dflash.yaml")
    loaded = tiny_target("llama", layers=4)
    drafter = build_drafter(str(tmp_path / "run"), loaded)
    assert isinstance(drafter, DFlashDrafter) and drafter.draft.config.block_size == 8
    prompt = torch.tensor([3, 1, 4, 1, 5])
    assert generate(loaded, prompt, drafter, 7, 16).tokens == generate(loaded, prompt, None, 0, 16).tokens


# ---- exports ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory):
    target = tiny_target("llama", layers=4)
    objective = build_objective("dflash", target, {"block_size": 4, "num_layers": 2})
    run = tmp_path_factory.mktemp("dflash")
    objective.save(objective.build_draft().eval(), run / "draft")
    (run / "config.yaml").write_text("draft: {kind: dflash}\n")
    return target, run


def test_a_draft_vocabulary_exports_with_its_head_and_vllms_offsets(tmp_path):
    from safetensors.torch import load_file

    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint, verify_export

    target = tiny_target("llama", layers=4)
    counts = torch.arange(target.vocab_size).flip(0)  # low ids most frequent
    objective = build_objective("dflash", target, {"block_size": 4, "draft_vocab_size": 100}, counts)
    objective.save(objective.build_draft().eval(), tmp_path / "draft")
    out = export_checkpoint(locate_checkpoint(str(tmp_path / "draft")), "vllm", tmp_path / "vllm")
    assert verify_export(out, "vllm")
    tensors = load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 100
    assert torch.equal(tensors["d2t"], torch.zeros(100, dtype=torch.long))  # ids 0..99: offsets all 0
    assert "t2d" not in tensors and tensors["lm_head.weight"].shape == (100, target.config.hidden_size)


def test_exports_to_vllms_layout_which_sglang_gets_too(dflash_run, tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint, verify_export

    target, run = dflash_run
    out = export_checkpoint(locate_checkpoint(str(run)), "vllm", tmp_path / "vllm")
    assert verify_export(out, "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 256, "target_layer_ids": [0, 1, 2]}
    assert config["block_size"] == 4 and config["layer_types"] == ["full_attention"] * 2
    assert config["rope_parameters"]["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert "eagle_config" not in config and "eagle_aux_hidden_state_layer_ids" not in config
    sglang = export_checkpoint(
        locate_checkpoint(str(run)), "sglang", tmp_path / "sglang"
    )  # SpecForge's folder
    assert verify_export(sglang, "sglang") and json.loads((sglang / "config.json").read_text()) == config
    # llama.cpp serves it beside its target's GGUF (tests/test_llamacpp_dflash.py), which this target has not
    assert main(["export", str(run), "--to", "gguf", "--out", str(tmp_path / "d.gguf")]) == 2
    assert "--target-gguf" in capsys.readouterr().err


def test_exports_to_the_speculators_format_and_reads_back_as_the_same_draft(tmp_path):
    """--to speculators writes speculators 0.9.0's DFlashSpeculator; draftsmith's reader of speculators' own
    DFlash drafts (drafts/dflash_import.py, held against speculators' forward in test_dflash_peers) reads it
    back to the draft's own logits, its vocabulary and its taps (vLLM's convention: draftsmith id + 1)."""
    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.drafts.dflash_import import import_dflash
    from draftsmith.export import export_checkpoint, verify_export

    target = tiny_target("llama", layers=4)
    counts = torch.arange(target.vocab_size).flip(0)
    objective = build_objective(
        "dflash", target, {"block_size": 4, "num_layers": 2, "draft_vocab_size": 100}, counts
    )
    draft = objective.build_draft().eval()
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape))
    objective.save(draft, tmp_path / "draft")
    out = export_checkpoint(locate_checkpoint(str(tmp_path / "draft")), "speculators", tmp_path / "spec")
    assert verify_export(out, "speculators")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    read = import_dflash(target, out)
    assert torch.equal(read.d2t, draft.d2t)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    target.set_capture(draft.config.capture_layer_ids)
    for d in (draft, read):
        target.reset()
        drafter = DFlashDrafter(d, target.model)
        drafter.begin(prompt[:-1], target.forward(prompt[:-1]).features)
        logits = drafter.block_logits(int(prompt[-1]), 8)
        if d is draft:
            want = logits
    target.set_capture(())
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def broken_export(run, engine: str, out, break_it):
    """``run`` exported ``--to engine`` under ``out``, its config.json and tensors edited by ``break_it(config,
    tensors)`` and written back: what a verifier must refuse."""
    from safetensors.torch import load_file, save_file

    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint

    folder = export_checkpoint(locate_checkpoint(str(run)), engine, out)
    config, tensors = (
        json.loads((folder / "config.json").read_text()),
        load_file(folder / "model.safetensors"),
    )
    break_it(config, tensors)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("break_it", "problem"),
    [
        (lambda c, t: c.update(aux_hidden_state_layer_ids=[3, 1]), "strictly increasing list of ids >= 1"),
        (lambda c, t: c.update(sample_from_anchor=True), "sample_from_anchor"),
        (lambda c, t: c.update(mask_token_id=10**6), "mask_token_id 1000000"),
        (lambda c, t: t.pop("layers.0.self_attn.k_norm.weight"), "missing layers.0.self_attn.k_norm.weight"),
    ],
)
def test_the_speculators_verifier_refuses_what_vllm_would_misread(dflash_run, tmp_path, break_it, problem):
    from draftsmith.export.verify import ExportVerificationError, verify_export

    out = broken_export(dflash_run[1], "speculators", tmp_path / "spec", break_it)
    with pytest.raises(ExportVerificationError, match=problem):
        verify_export(out, "speculators")


@pytest.mark.parametrize(
    ("break_it", "problem"),
    [
        (lambda c, t: c["dflash_config"].update(target_layer_ids=[2, 1, 0]), "strictly increasing"),
        (lambda c, t: c["dflash_config"].update(mask_token_id=10**6), "mask_token_id 1000000"),
        (lambda c, t: c.update(eagle_config={}), "eagle_config"),
        (lambda c, t: (c.pop("rope_theta"), c.pop("rope_parameters")), "no rope_theta"),
        (lambda c, t: c.update(layer_types=["sliding_attention"] * 2), "non-causal"),
        (lambda c, t: t.pop("layers.1.self_attn.k_norm.weight"), "missing layers.1.self_attn.k_norm.weight"),
        (lambda c, t: t.update(extra=torch.zeros(1)), "extra: vLLM's DFlash model has no such parameter"),
    ],
)
def test_the_vllm_verifier_refuses_what_vllm_would_guess_or_leave_uninitialised(dflash_run, tmp_path, break_it,
                                                                                problem):  # fmt: skip
    from draftsmith.export.verify import ExportVerificationError, verify_export

    out = broken_export(dflash_run[1], "vllm", tmp_path / "vllm", break_it)
    with pytest.raises(ExportVerificationError, match=problem):
        verify_export(out, "vllm")


# ---- the real target ----------------------------------------------------------------------------------


@dataclass
class SelfTrained:
    """What ``self_trained`` trained on and made: its prompts, and the walks validation simulates."""

    prompts: list[torch.Tensor]
    objective: Objective
    draft: torch.nn.Module
    batch: Batch
    teacher: Teacher

    def walks(self, k: int) -> list[list[int]]:
        """Per prompt, the accepted lengths of the verify steps greedy k-chain decoding of its answer takes,
        as validation simulates them (``decoding_walk_steps``)."""
        return decoding_walk_steps(*self.objective.chain_lengths(self.draft, self.batch, self.teacher, k))


def self_trained(kind: str, target, directory, prompts: int = 4, new: int = 48, steps: int = 40, lr: float = 3e-3,
                 **options) -> SelfTrained:  # fmt: skip
    """A draft of ``kind`` for the real target trained for a minute on its own greedy answers to the first dev
    prompts (first turns), saved in ``directory``. Decoding the same prompts then accepts some of its
    drafts, which a random draft never has."""
    from draftsmith.eval.prompts import load_prompts, render

    asked = [render(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
             for p in load_prompts("builtin:dev_prompts", prompts)]  # fmt: skip
    rows = [torch.cat([p, torch.tensor(generate(target, p, None, max_new_tokens=new).tokens)]) for p in asked]
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    real, learnt = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(asked, rows)):
        ids[i, : len(r)], real[i, : len(r)], learnt[i, len(p) : len(r)] = r, 1, 1
    batch = Batch(ids, real, learnt)
    counts = torch.bincount(ids[learnt.bool()], minlength=target.vocab_size)
    objective = build_objective(kind, target, options, counts)
    teacher = make_teacher(target, batch, objective.capture_layers, 64)
    draft, losses, _ = train(objective, batch, teacher, steps, lr=lr)
    assert losses[-1] < losses[0]
    objective.save(draft.eval(), directory)
    return SelfTrained(asked, objective, draft, batch, teacher)


def self_trained_dflash(target, directory, **options) -> SelfTrained:
    """``self_trained`` for a DFlash draft (48 blocks per row, the fixed slot decay)."""
    return self_trained(
        "dflash", target, directory, **{"anchors_per_row": 48, "slot_weighting": "decay", **options}
    )


@pytest.mark.slow
def test_greedy_output_equals_the_real_targets(tmp_path):
    """Two layers, block 16, a draft vocabulary of its own: every path a real draft takes (tests/test_vllm.py
    serves the 1-layer, full-vocabulary one)."""
    from draftsmith.decode.target import load_target

    target = load_target("smollm2-135m-instruct", device="cpu", dtype="float32")
    made = self_trained_dflash(target, tmp_path / "draft", num_layers=2, block_size=16, draft_vocab_size=8192)
    drafter = build_drafter(str(tmp_path / "draft"), target)
    k = drafter.draft.config.block_size - 1
    for prompt, walk in zip(made.prompts, made.walks(k)):
        result = generate(target, prompt, drafter, k, 48)
        assert result.tokens == generate(target, prompt, None, max_new_tokens=48).tokens
        # the saved draft, decoding, accepts step by step what validation's walk along this answer predicts
        assert result.accepted[: len(walk)] == walk, (result.accepted, walk)
    assert sum(map(sum, made.walks(k))) > 0  # trained on these very answers: some blocks are accepted
