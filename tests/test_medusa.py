"""Medusa heads (drafts/medusa.py), their drafter and objective, on tiny random targets."""

from __future__ import annotations

import json

import pytest
import torch
from test_eagle import make_teacher, self_distilled_batch, train
from tiny import tiny_target, train_debug_recipe

from draftsmith.decode.features import LAYER_ID_CONVENTION, capture_layers
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.speculative import generate
from draftsmith.decode.tree import TreeSpec
from draftsmith.decode.tree_decode import generate_tree
from draftsmith.drafts.base import build_drafter, check_target
from draftsmith.drafts.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from draftsmith.train.registry import build_objective

ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param, layers=4)


@pytest.mark.parametrize("shared", [False, True])
def test_shapes_and_start_as_the_targets_head(target, shared):
    cfg = MedusaConfig.for_target(target, num_heads=3, shared_lm_head=shared)
    heads = MedusaHeads(cfg)
    heads.init_from_target(target.model)
    H, V, L = target.config.hidden_size, target.vocab_size, target.config.num_hidden_layers
    assert cfg.capture_layer_ids == [L - 1]
    out = heads(torch.randn(2, 5, H))
    assert [x.shape for x in out] == [(2, 5, V)] * 3
    select = torch.zeros(3, 2, 5, dtype=torch.bool)
    select[1, 0, :3] = True
    assert [x.shape[0] for x in heads(torch.randn(2, 5, H), logit_masks=select)] == [0, 3, 0]
    assert len(heads(torch.randn(1, H), num_heads=2)) == 2
    trainable = {n for n, p in heads.named_parameters() if p.requires_grad}
    assert all(".linear." in n or n.startswith("lm_heads.") for n in trainable) and trainable
    assert not shared or not any(n.startswith("lm_head") for n in trainable)
    # zero residual blocks + copied norm and LM head: every head reproduces the target's own logits
    ids = torch.randint(0, 256, (1, 7))
    with capture_layers(target.model, [L - 1]) as store:
        logits = target.model(input_ids=ids).logits
    for head in heads(store[L - 1]):
        assert torch.allclose(head, logits, atol=1e-4)


def test_save_load_round_trip_and_target_check(target, tmp_path):
    heads = build_objective("medusa", target, {"num_heads": 2}).build_draft().eval()
    with torch.no_grad():
        heads.heads[1][0].linear.weight.normal_()  # something a round trip could lose
    heads.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["draftsmith_kind"] == "medusa" and saved["model_type"] == "draftsmith_medusa"
    assert saved["target"] == target.record() and saved["layer_id_convention"] == LAYER_ID_CONVENTION
    assert saved["capture_layer_ids"] == [target.config.num_hidden_layers - 1]
    loaded = MedusaHeads.from_pretrained(tmp_path).eval()
    x = torch.randn(3, target.config.hidden_size)
    for a, b in zip(heads(x), loaded(x)):
        assert torch.equal(a, b)
    drafter = build_drafter(str(tmp_path), target)
    assert isinstance(drafter, MedusaDrafter) and drafter.capture_layers == (
        target.config.num_hidden_layers - 1,
    )
    with pytest.raises(ValueError, match="checkpoint directory"):
        build_drafter("medusa", target)

    other = tiny_target("qwen2" if target.config.model_type == "llama" else "llama", layers=4)
    with pytest.raises(ValueError, match=rf"Medusa draft was trained for.*{target.name}.*{other.name}"):
        build_drafter(str(tmp_path), other)
    with pytest.raises(ValueError, match="num_hidden_layers differs"):
        check_target(loaded.config.target, tiny_target(target.config.model_type, layers=3), "Medusa draft")


def test_options_are_checked(target):
    with pytest.raises(ValueError, match="num_heads"):
        build_objective("medusa", target, {"num_head": 3})


@pytest.mark.parametrize("hard", [False, True])
def test_training_lowers_the_loss_and_decoding_stays_lossless(target, hard):
    batch = self_distilled_batch(target)
    objective = build_objective("medusa", target, {"num_heads": 3, "hard_labels": hard})
    assert objective.teacher_topk == (1 if hard else 64)
    teacher = make_teacher(target, batch, objective.capture_layers, 64)
    untrained = objective.build_draft().eval()
    k = 3
    before = objective.acceptance(untrained, batch, teacher, k)
    heads, losses, logs = train(objective, batch, teacher, steps=40)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses
    assert {"ce_0", "ce_2", "acc_0", "acc_2", "tokens"} <= set(logs)
    after = objective.acceptance(heads, batch, teacher, k)
    assert after.shape == (k + 1,) and int(after.sum()) > 0 and int(before.sum()) > 0
    mean_len = lambda h: float((h * torch.arange(k + 1)).sum() / h.sum())  # noqa: E731
    assert mean_len(after) > mean_len(before)

    # lossless chains from a trained, saved and exported draft: the kind contract (tests/test_kind_contract.py)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=20).tokens
    result = generate(target, prompt, MedusaDrafter(heads), k=4, max_new_tokens=20)
    assert max(result.proposed) <= 3  # never more drafts than heads
    auto = generate(target, prompt, MedusaDrafter(heads), k="auto", max_new_tokens=20)
    assert auto.tokens == reference
    drafter = MedusaDrafter(heads)
    assert drafter.supports_tree
    tree = generate_tree(
        target, prompt, drafter, TreeSpec(depth=3, top_k=3, total_tokens=8), max_new_tokens=20
    )
    assert tree.tokens == reference and sum(tree.accepted) > 0


def test_sampled_proposals_carry_their_distributions(target):
    heads = build_objective("medusa", target, {"num_heads": 3}).build_draft().eval()
    drafter = MedusaDrafter(heads)
    prompt = torch.randint(0, 256, (7,))
    sampling = Sampling(temperature=0.8, top_k=20)
    result = generate(target, prompt, drafter, 3, 12, sampling, torch.Generator().manual_seed(0))
    assert 1 <= len(result.tokens) <= 12 and all(0 <= t < target.vocab_size for t in result.tokens)
    target.set_capture(drafter.capture_layers)
    target.reset()
    step = target.forward(prompt)
    drafter.begin(prompt, step.features)
    proposal = drafter.propose(prompt, 5, sampling, torch.Generator().manual_seed(0))
    assert proposal.probs.shape == (3, target.vocab_size)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3))
    assert bool((proposal.probs[torch.arange(3), proposal.tokens] > 0).all())
    tree = drafter.propose_tree(prompt, TreeSpec(depth=5, top_k=2, total_tokens=5), sampling, None)
    assert tree.num_drafts == 5 and tree.depth <= 3  # no deeper than the heads
    assert int(tree.tokens[0]) == int(prompt[-1])
    target.set_capture(())
    with pytest.raises(ValueError, match="needs the target's features"):
        drafter.begin(prompt, None)


def test_trains_in_the_loop(tmp_path):
    """The debug recipe's objective through the one loop on a tiny saved target: exported, loadable."""
    result, _ = train_debug_recipe(tmp_path, "debug_medusa.yaml", layers=2)
    loaded = tiny_target("llama", layers=2)
    assert isinstance(build_drafter(str(result.draft_dir), loaded), MedusaDrafter)
