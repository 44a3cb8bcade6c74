"""EAGLE heads (drafts/eagle.py), their drafter and their objectives, on tiny random targets."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from tiny import tiny_target
from transformers import DynamicCache

from draftsmith.decode.features import LAYER_ID_CONVENTION, capture_layers
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.speculative import generate
from draftsmith.drafts.base import build_drafter
from draftsmith.drafts.eagle import EagleConfig, EagleHead, check_target
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.eagle_parts import build_vocab_map, shrink_head_vocab, ttt_attention_mask
from draftsmith.train.losses import soft_topk_cross_entropy
from draftsmith.train.objective import Batch, Teacher, decoding_walk_steps
from draftsmith.train.objectives.common import step_valid_masks
from draftsmith.train.objectives.eagle import EagleObjective
from draftsmith.train.registry import build_objective

ARCHS = ["llama", "qwen2"]
PRESETS = ["eagle1", "eagle3"]
DRAFT_VOCAB = 120  # < the tiny vocabulary of 259, so EAGLE-3 maps ids


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param, layers=8)


@pytest.fixture(scope="module")
def batch(target) -> Batch:
    return self_distilled_batch(target)


def self_distilled_batch(target, n: int = 2, prompt_len: int = 6, new: int = 24) -> Batch:
    """Prompts of random bytes followed by the target's own greedy continuation (the learnt part)."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        prompt = torch.randint(0, 256, (prompt_len,), generator=gen)
        out = generate(target, prompt, None, max_new_tokens=new).tokens
        rows.append(torch.cat([prompt, torch.tensor(out)]))
    T = max(len(r) for r in rows)
    ids = torch.zeros(n, T, dtype=torch.long)
    attn, learnt = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)], learnt[i, prompt_len : len(r)] = r, 1, 1
    return Batch(ids, attn, learnt)


def make_teacher(target, batch: Batch, layers, k: int) -> Teacher:
    with torch.no_grad(), capture_layers(target.model, list(layers)) as store:
        logits = target.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        features = {i: store[i].clone() for i in layers}
    top = logits.topk(k, dim=-1)
    return Teacher(features, top.values, top.indices)


def objective_for(target, preset: str, batch: Batch | None = None, **options) -> EagleObjective:
    if batch is None:
        counts = torch.arange(target.vocab_size).flip(0)  # low ids most frequent
    else:
        counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    return build_objective(preset, target, {"draft_vocab_size": DRAFT_VOCAB, **options}, counts)


def train(objective, batch, teacher, steps: int = 30, lr: float = 1e-2):
    torch.manual_seed(0)
    head = objective.build_draft()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        out = objective.loss(head, batch, teacher)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    return head.eval(), losses, out


@pytest.mark.parametrize("preset", PRESETS)
def test_head_shapes(target, preset):
    cfg = EagleConfig.for_target(target, preset, draft_vocab_size=DRAFT_VOCAB, ttt_steps=2)
    head = EagleHead(cfg)
    head.init_from_target(target.model)
    H, V = target.config.hidden_size, target.vocab_size
    vd = DRAFT_VOCAB if preset == "eagle3" else V
    assert cfg.capture_layer_ids == ([7] if preset == "eagle1" else [1, 3, 4])
    feats = {i: torch.randn(2, 5, H) for i in cfg.capture_layer_ids}
    out = head(torch.randint(0, V, (2, 5)), feats, steps=2)
    assert [h.shape for h in out.hidden_states] == [(2, 5, H)] * 2
    assert [x.shape for x in out.logits] == [(2, 5, vd)] * 2
    select = torch.zeros(2, 2, 5, dtype=torch.bool)
    select[:, 0, :3] = True
    assert head(torch.randint(0, V, (2, 5)), feats, steps=2, logit_masks=select).logits[1].shape == (3, vd)
    assert not head.embed_tokens.weight.requires_grad
    assert torch.equal(head.embed_tokens.weight, target.model.get_input_embeddings().weight)
    if preset == "eagle1":  # the target's final norm + LM head reproduce its logits from the last feature
        with capture_layers(target.model, [7]) as store:
            ids = torch.randint(0, V, (1, 6))
            logits = target.model(input_ids=ids).logits
        assert torch.allclose(head.draft_logits(store[7]), logits, atol=1e-4)
        assert not any(p.requires_grad for p in head.norm.parameters())


def test_ttt_attention_mask_matches_hand_built():
    c, e = [[1, 0, 0], [1, 1, 0], [1, 1, 1]], [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    for step in range(3):
        expected = torch.tensor(
            [c[i] + sum((e[i] for _ in range(step)), []) for i in range(3)], dtype=torch.bool
        )
        assert torch.equal(ttt_attention_mask(3, step), expected)


@pytest.mark.parametrize("preset", PRESETS)
def test_unroll_equals_chain_drafting_with_a_cache(target, preset):
    """Step j of the TTT unroll at anchor t computes what chain drafting from anchor t computes."""
    cfg = EagleConfig.for_target(target, preset, draft_vocab_size=DRAFT_VOCAB)
    torch.manual_seed(0)
    head = EagleHead(cfg).eval()
    T, H, t = 9, target.config.hidden_size, 4
    ids = torch.randint(0, 256, (1, T))
    feats = {i: torch.randn(1, T, H) for i in cfg.capture_layer_ids}
    unrolled = head(ids, feats, steps=3).hidden_states
    cache = DynamicCache()
    causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None, None]
    hidden = head.step(
        head.fuse(feats)[:, : t + 1], ids[:, 1 : t + 2], torch.arange(t + 1)[None], causal, cache
    )
    hidden = hidden[:, -1:]
    for j in (1, 2):
        hidden = head.step(hidden, ids[:, t + 1 + j : t + 2 + j], torch.tensor([[t + j]]), None, cache)
        assert torch.allclose(hidden[0, 0], unrolled[j][0, t], atol=1e-5)


def test_build_vocab_map_keeps_the_most_frequent():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = build_vocab_map(counts, 3)  # the three largest counts: 9 (id 2), 9 (id 3), 7 (id 5)
    assert d2t.tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]
    assert torch.equal(t2d.nonzero().squeeze(1), d2t)
    assert torch.equal(t2d.long().cumsum(0)[d2t] - 1, torch.arange(3))  # draft id of each kept target id
    d2t, t2d = build_vocab_map(counts, 100)
    assert torch.equal(d2t, torch.arange(6)) and bool(t2d.all())


def test_soft_topk_cross_entropy_by_hand():
    draft = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    teacher = torch.log(torch.tensor([[0.6, 0.2, 0.2]]))
    ce, has = soft_topk_cross_entropy(draft, teacher, torch.tensor([[0, 2, -1]]))
    # teacher renormalised over the in-vocabulary ids: 0.75 on draft id 0, 0.25 on draft id 2
    expected = -(0.75 * torch.log(torch.tensor(0.5)) + 0.25 * torch.log(torch.tensor(0.25)))
    assert torch.allclose(ce, expected.view(1)) and has.tolist() == [True]
    _, has = soft_topk_cross_entropy(draft, teacher, torch.full((1, 3), -1))
    assert has.tolist() == [False]


@pytest.mark.parametrize("preset", PRESETS)
def test_save_load_round_trip_and_target_check(target, preset, tmp_path):
    head = objective_for(target, preset, ttt_steps=2).build_draft().eval()
    head.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["draftsmith_kind"] == preset and saved["layer_id_convention"] == LAYER_ID_CONVENTION
    assert saved["target"] == target.record() and saved["ttt_steps"] == 2
    loaded = EagleHead.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    if preset == "eagle3":
        assert loaded.d2t.tolist() == list(range(DRAFT_VOCAB))
    feats = {i: torch.randn(1, 6, target.config.hidden_size) for i in head.config.capture_layer_ids}
    ids = torch.randint(0, 256, (1, 6))
    for a, b in zip(head(ids, feats, steps=2).logits, loaded(ids, feats, steps=2).logits):
        assert torch.equal(a, b)
    drafter = build_drafter(str(tmp_path), target)
    assert isinstance(drafter, EagleDrafter) and drafter.capture_layers == tuple(
        head.config.capture_layer_ids
    )

    with pytest.raises(ValueError, match="checkpoint directory"):
        build_drafter(preset, target)

    other = tiny_target("qwen2" if target.config.model_type == "llama" else "llama", layers=8)
    with pytest.raises(ValueError, match=rf"{target.name}.*{other.name}.*model_type"):
        build_drafter(str(tmp_path), other)
    deeper = tiny_target(target.config.model_type, layers=6)
    with pytest.raises(ValueError, match="num_hidden_layers differs"):
        check_target(loaded.config, deeper)


def test_eagle3_needs_token_counts_for_a_reduced_vocabulary(target):
    with pytest.raises(ValueError, match="token_counts"):
        build_objective("eagle3", target, {"draft_vocab_size": DRAFT_VOCAB})
    full = build_objective("eagle3", target, {"draft_vocab_size": 10_000}).build_draft()
    assert full.config.draft_vocab_size == 259 and torch.equal(full.d2t, torch.arange(259))
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        build_objective("eagle3", target, {"draft_vocab_size": 10_000, "num_layers": 0})
    with pytest.raises(ValueError, match="step_decay"):  # a misspelt option names the right one
        build_objective("eagle3", target, {"step_decy": 0.5})


@pytest.mark.parametrize("preset", PRESETS)
def test_loss_counts_only_learnt_positions(target, batch, preset):
    objective = objective_for(target, preset, batch, ttt_steps=2)
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    head = objective.build_draft()
    before = objective.loss(head, batch, teacher)
    # learnt tokens start at 6, so teacher positions 0..4 (which predict tokens 1..5) are never scored
    teacher.topk_logits[:, :5] = torch.randn_like(teacher.topk_logits[:, :5])  # (a fresh Teacher per test)
    teacher.topk_ids[:, :5] = teacher.topk_ids[:, :5].roll(1, dims=-1)
    after = objective.loss(head, batch, teacher)
    assert torch.equal(before["loss"], after["loss"])
    assert float(before["tokens"]) == float(batch.loss_mask[:, 2:].sum())


@pytest.mark.parametrize("preset", PRESETS)
def test_validation_walk_takes_the_steps_decoding_takes(target, preset):
    """The simulated acceptance behind val/tau, step by step, is what chain decoding does on the same text."""
    k, prompt_len, new = 3, 6, 40
    batch = self_distilled_batch(target, n=2, prompt_len=prompt_len, new=new)
    objective = objective_for(target, preset, batch, ttt_steps=3 if preset == "eagle3" else 1)
    head, _, _ = train(objective, batch, make_teacher(target, batch, objective.capture_layers, 64))
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    walks = decoding_walk_steps(*objective.chain_lengths(head, batch, teacher, k))
    compared = 0
    for row, walk in zip(batch.input_ids, walks):
        result = generate(target, row[:prompt_len], EagleDrafter(head), k=k, max_new_tokens=new)
        assert result.tokens == row[prompt_len : prompt_len + len(result.tokens)].tolist()
        full = list(itertools.takewhile(lambda step: step[1] == k, zip(result.accepted, result.chosen_k)))
        n = min(len(walk), len(full))
        assert walk[:n] == [a for a, _ in full[:n]]
        compared += n
    assert compared >= 10 and len(set(itertools.chain(*walks))) > 1  # several steps, not all alike


@pytest.mark.parametrize("preset", PRESETS)
def test_loss_decreases_and_simulated_acceptance_grows(target, batch, preset):
    """On every architecture; decoding with the trained head, saved and exported, is the kind contract's
    (tests/test_kind_contract.py)."""
    objective = objective_for(target, preset, batch, ttt_steps=3 if preset == "eagle3" else 1)
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    untrained = objective.build_draft().eval()
    k = 3
    hist_before = objective.acceptance(untrained, batch, teacher, k)
    head, losses, logs = train(objective, batch, teacher)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses
    steps = 3 if preset == "eagle3" else 1
    assert {f"acc_{j}" for j in range(steps)} | {"oov_frac", "loss"} <= set(logs)
    hist_after = objective.acceptance(head, batch, teacher, k)
    assert hist_after.shape == (k + 1,) and int(hist_after.sum()) > 0 and int(hist_before.sum()) > 0
    mean_len = lambda h: float((h * torch.arange(k + 1)).sum() / h.sum())  # noqa: E731
    assert mean_len(hist_after) > mean_len(hist_before)


@pytest.mark.parametrize("preset", PRESETS)
def test_sampled_decoding_returns_valid_tokens(target, preset):
    head = objective_for(target, preset).build_draft().eval()
    drafter = EagleDrafter(head)
    prompt = torch.randint(0, 256, (7,))
    sampling = Sampling(temperature=0.9, top_k=50)
    result = generate(
        target,
        prompt,
        drafter,
        k=3,
        max_new_tokens=12,
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
    )
    assert 1 <= len(result.tokens) <= 12 and all(0 <= t < target.vocab_size for t in result.tokens)
    # a proposal's distributions live on the target vocabulary and vanish outside the draft vocabulary
    target.reset()
    target.set_capture(drafter.capture_layers)
    step = target.forward(prompt)
    drafter.begin(prompt, step.features)
    tokens = torch.cat([prompt, step.logits[-1:].argmax(-1)])
    proposal = drafter.propose(tokens, 3, sampling, torch.Generator().manual_seed(0))
    assert proposal.probs.shape == (3, target.vocab_size)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3))
    assert float(proposal.probs[:, ~head.t2d].sum()) == 0.0
    assert bool(head.t2d[proposal.tokens].all())
    target.set_capture(())


def test_shrink_vocab_keeps_the_most_frequent_rows_and_stays_lossless(target, batch, tmp_path):
    objective = objective_for(target, "eagle3", batch, ttt_steps=2)
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    head, _, _ = train(objective, batch, teacher, steps=10)
    head.eval()
    before_d2t, before_w = head.d2t.clone(), head.lm_head.weight.detach().clone()
    counts = torch.bincount(batch.input_ids.flatten(), minlength=target.vocab_size)
    counts[before_d2t[7]] = 10_000  # a row that must survive
    shrink_head_vocab(head, counts, 40)

    d2t = head.d2t
    assert d2t.tolist() == sorted(d2t.tolist()) and len(d2t) == 40 == head.config.draft_vocab_size
    assert int(before_d2t[7]) in d2t.tolist()
    kept = {int(t) for t in d2t}
    dropped = [int(t) for t in before_d2t if int(t) not in kept]
    assert max(counts[dropped]) <= min(counts[d2t])  # only the rarest went
    assert head.t2d.sum() == 40 and bool(head.t2d[d2t].all())
    rows = [before_d2t.tolist().index(t) for t in d2t.tolist()]
    assert torch.equal(head.lm_head.weight, before_w[rows])  # rows copied, not retrained

    head.save_pretrained(tmp_path)
    loaded = EagleHead.from_pretrained(tmp_path).eval()
    assert loaded.config.draft_vocab_size == 40 and torch.equal(loaded.d2t, d2t)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=20).tokens
    assert (
        generate(target, prompt, build_drafter(str(tmp_path), target), k=4, max_new_tokens=20).tokens
        == reference
    )

    with pytest.raises(ValueError, match="must be in 1..40"):
        shrink_head_vocab(loaded, counts, 41)
    eagle1 = objective_for(target, "eagle1").build_draft()
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        shrink_head_vocab(eagle1, counts, 10)


def test_a_frozen_lm_head_stays_the_targets_rows_while_the_rest_trains(target, batch, monkeypatch):
    """``freeze_lm_head`` (speculators' way): the head's readout is the target's LM head at the draft
    vocabulary before and after training, and is no parameter the optimizer sees; the rest of the head trains.
    Without it the readout trains too. A target whose readout the head cannot copy is refused."""
    objective = objective_for(target, "eagle3", batch, ttt_steps=2, freeze_lm_head=True)
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    rows = target.model.get_output_embeddings().weight.detach()
    start = objective.build_draft()
    assert not start.lm_head.weight.requires_grad and start.fuse_features.weight.requires_grad
    assert torch.equal(start.lm_head.weight, rows[start.d2t])
    head, losses, _ = train(objective, batch, teacher, steps=10)
    assert torch.equal(head.lm_head.weight, rows[head.d2t])
    assert not torch.equal(head.fuse_features.weight, start.fuse_features.weight) and losses[-1] < losses[0]
    trained, _, _ = train(objective_for(target, "eagle3", batch, ttt_steps=2), batch, teacher, steps=10)
    assert not torch.equal(trained.lm_head.weight, rows[trained.d2t])

    monkeypatch.setattr("draftsmith.drafts.eagle.copy_final_norm", lambda model, norm: False)
    with pytest.raises(ValueError, match="freeze_lm_head: false"):
        objective_for(target, "eagle3", batch, freeze_lm_head=True).build_draft()


VARIANTS = [{"norm_before_fc": True}, {"norm_output": True}, {"norm_before_residual": True},
            {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}]  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(v))
def test_eagle31_norms_train_unroll_as_they_draft_and_stay_lossless(target, batch, variant, tmp_path):
    """The EAGLE-3.1 norms as training options: the head is built with them, trains, its TTT unroll computes what
    chain drafting computes, it survives a save and load, and greedy speculative output is the target's own."""
    objective = objective_for(target, "eagle3", batch, ttt_steps=3, **variant)
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    head, losses, _ = train(objective, batch, teacher, steps=10)
    assert all(getattr(head.config, key) for key in variant) and losses[-1] < losses[0]
    assert hasattr(head, "fuse_norm") == ("norm_before_fc" in variant)
    T, t = batch.input_ids.shape[1], 5
    feats = {i: teacher.features[i][:1] for i in objective.capture_layers}
    ids = batch.input_ids[:1]
    unrolled = head(ids, feats, steps=3).hidden_states
    cache = DynamicCache()
    causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None, None]
    hidden = head.step(
        head.fuse(feats)[:, : t + 1], ids[:, 1 : t + 2], torch.arange(t + 1)[None], causal, cache
    )
    hidden = hidden[:, -1:]
    for j in (1, 2):
        hidden = head.step(hidden, ids[:, t + 1 + j : t + 2 + j], torch.tensor([[t + j]]), None, cache)
        assert torch.allclose(hidden[0, 0], unrolled[j][0, t], atol=1e-5)
    assert T > t + 3
    head.save_pretrained(tmp_path)
    assert all(getattr(EagleHead.from_pretrained(tmp_path).config, key) for key in variant)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=20).tokens
    assert (
        generate(target, prompt, build_drafter(str(tmp_path), target), k=4, max_new_tokens=20).tokens
        == reference
    )


def test_eagle31_norms_are_eagle3_options_only(target):
    """EAGLE-1 has no fused feature or feedback norm to add: its options refuse the keys before a target loads."""
    from draftsmith.train.registry import options_class, parse_options

    for kind in ("eagle3", "mirror"):
        assert parse_options(kind, options_class(kind), {"norm_output": True})["norm_output"] is True
    with pytest.raises(ValueError, match="norm_output"):
        parse_options("eagle1", options_class("eagle1"), {"norm_output": True})


def test_feature_noise_is_uniform_bounded_and_training_only(target, batch):
    """``feature_noise`` a: every tapped feature moves by at most a, by more than a/2 somewhere, in training steps
    only; validation (eval mode) reads the target's features untouched, so its loss is the noiseless one."""
    objective = objective_for(target, "eagle3", batch, ttt_steps=2, feature_noise=0.05)
    plain = objective_for(target, "eagle3", batch, ttt_steps=2)
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    noisy = objective.noisy(teacher.features)
    for i, f in teacher.features.items():
        moved = (noisy[i] - f).abs()
        assert moved.max() <= 0.05 + 1e-6 and moved.max() > 0.025 and moved.mean() > 0.02
    assert plain.noisy(teacher.features) is teacher.features
    torch.manual_seed(0)
    head = objective.build_draft()
    head.train()
    with torch.no_grad():
        a = objective.loss(head, batch, teacher)["loss"]
        b = plain.loss(head, batch, teacher)["loss"]
        head.eval()
        c, d = objective.loss(head, batch, teacher)["loss"], plain.loss(head, batch, teacher)["loss"]
    assert not torch.equal(a, b) and torch.equal(c, d)
    with pytest.raises(ValueError, match="feature_noise"):
        objective_for(target, "eagle3", batch, feature_noise=-0.1)


@pytest.mark.parametrize(
    "options",
    [{"step_weighting": "dpace"}, {"step_weighting": "walk"}, {"loss": "lk_hybrid"},
     {"step_weighting": "dpace", "loss": "lk_hybrid", "dpace_alpha": 0.3}],
    ids=lambda o: "-".join(map(str, o.values())),
)  # fmt: skip
def test_acceptance_oriented_losses_train(target, batch, options):
    """D-PACE / walk weighting and the LK^λ loss train an EAGLE-3 head (finite, falling loss); the per-anchor
    weights put the most on step 0 and never grow with the step, and at dpace_alpha 1 step j of an anchor weighs
    its valid steps from j on (3, 2, 1 where all are valid)."""
    objective = objective_for(target, "eagle3", batch, ttt_steps=3, **options)
    teacher = make_teacher(target, batch, objective.capture_layers, objective.teacher_topk)
    head, losses, out = train(objective, batch, teacher, steps=12)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.9 * losses[0]
    if "step_weighting" in options:
        w = [float(out[f"weight_{j}"]) for j in range(3)]
        assert w[0] >= w[1] >= w[2] > 0, w
        flat = objective_for(target, "eagle3", batch, ttt_steps=3, **{**options, "dpace_alpha": 1.0})
        out = flat.loss(head, batch, teacher)
        valid = step_valid_masks(batch, 3).long()
        reach = valid.flip(0).cumsum(0).flip(0)  # valid steps m >= j of each anchor
        expected = [float(reach[j][valid[j].bool()].float().mean()) for j in range(3)]
        assert [float(out[f"weight_{j}"]) for j in range(3)] == pytest.approx(expected)
        assert expected[2] == 1.0 and expected[0] > 2.5
    if options.get("loss") == "lk_hybrid":
        assert 0 < float(out["acceptance_0"]) <= 1


def test_acceptance_oriented_options_are_eagle3_only(target, batch):
    from draftsmith.train.registry import options_class, parse_options

    for key, value in (("step_weighting", "dpace"), ("loss", "lk_hybrid")):
        with pytest.raises(ValueError, match=key):
            parse_options("eagle1", options_class("eagle1"), {key: value})
    with pytest.raises(ValueError, match="step_weighting"):
        parse_options("eagle3", options_class("eagle3"), {"step_weighting": "dpac"})
    with pytest.raises(ValueError, match="dpace_alpha"):
        parse_options("eagle3", options_class("eagle3"), {"dpace_alpha": 0})
