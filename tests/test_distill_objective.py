"""The DistillSpec objective on a tiny target: it learns, it measures acceptance, it samples on-policy."""

import pytest
import torch
from tiny import tiny_target

from draftsmith.decode.speculative import generate
from draftsmith.drafts.base import kind_of_checkpoint
from draftsmith.train import losses
from draftsmith.train.objective import Batch, Teacher, decoding_walk
from draftsmith.train.objectives import distill, on_policy
from draftsmith.train.objectives.distill import DistillObjective, DistillOptions
from draftsmith.train.registry import build_objective


def _batch() -> Batch:
    """Two right-padded rows: a 4-token prompt (mask 0), then assistant tokens (mask 1)."""
    rows = [[5, 17, 42, 99, 3, 250, 7, 64, 120, 33, 8, 201], [11, 12, 13, 14, 60, 61, 62, 63, 64]]
    ids = torch.zeros(2, 12, dtype=torch.long)
    attn, learn = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        attn[b, : len(row)] = 1
        learn[b, 4 : len(row)] = 1
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=learn)


def _teacher(target, batch: Batch, k: int) -> Teacher:
    with torch.no_grad():
        logits = target.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    if k >= logits.shape[-1]:
        ids = torch.arange(logits.shape[-1]).expand(logits.shape)
        return Teacher(features={}, topk_logits=logits, topk_ids=ids)
    values, ids = logits.topk(k, dim=-1)
    return Teacher(features={}, topk_logits=values, topk_ids=ids)


@pytest.mark.parametrize(
    "options",
    [
        {"init": "config", "num_layers": 1, "hidden_size": 16, "loss": "fkl"},
        {
            "init": "config",
            "num_layers": 1,
            "hidden_size": 16,
            "loss": "jsd",
            "beta": 0.5,
            "teacher_topk": 16,
        },
        {"init": "target_layers", "num_layers": 2, "loss": "rkl", "temperature": 2.0},
        {"init": "target_layers", "layer_ids": [1], "loss": "tvd"},
        {"init": "target_layers", "num_layers": 1, "loss": "ce", "lora": {"r": 4, "alpha": 8}},
    ],
)
def test_loss_decreases_on_a_fixed_batch(options):
    target = tiny_target("llama")
    objective = DistillObjective(target, DistillOptions(**options))
    draft = objective.build_draft()
    batch = _batch()
    teacher = _teacher(target, batch, objective.teacher_topk)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    history = []
    for _ in range(20):
        out = objective.loss(draft, batch, teacher)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        history.append(float(out["loss"].detach()))
    # 8 + 5 assistant tokens; each is predicted from the position before it
    assert int(out["num_tokens"]) == objective.num_loss_tokens(batch) == 8 + 5
    assert history[-1] < 0.7 * history[0], history


def test_full_teacher_loss_equals_the_pure_function_and_token_counts_accumulate():
    target = tiny_target("llama")
    objective = DistillObjective(target, DistillOptions(init="target_layers", num_layers=2, loss="fkl"))
    assert objective.teacher_topk == target.vocab_size
    draft = objective.build_draft()
    batch = _batch()
    teacher = _teacher(target, batch, objective.teacher_topk)
    out = objective.loss(draft, batch, teacher, num_tokens=100)
    logits = draft(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    mask = distill.next_token_mask(batch)
    expected = losses.forward_kl(logits, teacher.topk_logits[:, :-1], mask)
    assert float(out["loss_sum"].detach()) == pytest.approx(float(expected.total), rel=1e-5)
    assert float(out["loss"]) == pytest.approx(float(expected.total) / 100, rel=1e-5)
    # position t is learnt when token t + 1 is an assistant token: the prompt's last position counts
    assert mask[0, 3] and not mask[0, 2] and not mask[1, 8]


def test_micro_batches_with_the_step_token_count_give_the_whole_batch_gradient():
    target = tiny_target("llama")
    objective = DistillObjective(
        target, DistillOptions(init="config", num_layers=1, hidden_size=16, loss="jsd")
    )
    draft = objective.build_draft()
    batch = _batch()
    teacher = _teacher(target, batch, objective.teacher_topk)
    objective.loss(draft, batch, teacher)["loss"].backward()
    whole = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()
    micro = [
        (
            Batch(batch.input_ids[r], batch.attention_mask[r], batch.loss_mask[r]),
            Teacher({}, teacher.topk_logits[r], teacher.topk_ids[r]),
        )
        for r in (slice(0, 1), slice(1, 2))
    ]
    step_tokens = sum(objective.num_loss_tokens(b) for b, _ in micro)
    for b, t in micro:
        objective.loss(draft, b, t, num_tokens=step_tokens)["loss"].backward()
    for name, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], rtol=1e-4, atol=1e-6, msg=name)


def test_chain_run_lengths_by_hand():
    agree = torch.tensor([[1, 1, 0, 1, 1, 1]])
    valid = torch.ones_like(agree)
    # runs from each start, capped at k = 2; decoding drafts at t = 0 (accepts 2), then at t = 3
    # (accepts 2), and the row ends
    assert distill.chain_run_lengths(agree, valid, 2).tolist() == [[2, 1, 0, 2, 2, 1]]
    assert decoding_walk(distill.chain_run_lengths(agree, valid, 2), valid, 2).tolist() == [0, 0, 2]
    valid[0, 4] = 0  # an invalid position ends runs and starts none: t = 0 (2), t = 3 (1), t = 5 (1)
    lengths = distill.chain_run_lengths(agree, valid, 2)
    assert lengths.tolist() == [[2, 1, 0, 1, 0, 1]]
    assert decoding_walk(lengths, valid, 2).tolist() == [0, 2, 1]


def test_acceptance_of_an_exact_copy_and_of_a_fresh_draft():
    target = tiny_target("llama")
    batch = _batch()
    exact = DistillObjective(target, DistillOptions(init="target_layers", num_layers=4))
    teacher = _teacher(target, batch, exact.teacher_topk)
    counts = exact.acceptance(exact.build_draft(), batch, teacher, k=3)
    assert counts.shape == (4,) and int(counts[3]) > 0
    assert int(counts[0]) == 0  # every position agrees; runs are only cut by the end of a row
    # each step covers its accepted tokens and the target's own: no learnt position is counted twice
    assert (
        int((counts * torch.arange(1, 5)).sum())
        <= exact.num_loss_tokens(batch) + batch.input_ids.shape[0] * 3
    )
    fresh = DistillObjective(
        target, DistillOptions(init="config", num_layers=1, hidden_size=16, teacher_topk=8)
    )
    counts = fresh.acceptance(fresh.build_draft(), batch, _teacher(target, batch, 8), k=3)
    assert 0 < int(counts.sum()) <= fresh.num_loss_tokens(batch) and int(counts[0]) > 0


def test_registered_and_saved_as_a_causal_lm_draft(tmp_path):
    target = tiny_target("llama")
    objective = build_objective("distill", target, {"init": "target_layers", "layer_ids": [0, 2]})
    assert isinstance(objective, DistillObjective)
    objective.save(objective.build_draft(), tmp_path / "draft")
    assert kind_of_checkpoint(tmp_path / "draft").name == "distill"
    with pytest.raises(ValueError, match="unknown key 'draft.options.layers'.*Valid keys"):
        build_objective("distill", target, {"layers": 2})
    with pytest.raises(ValueError, match="choose one of"):
        build_objective("distill", target, {"loss": "kl"})


def test_on_policy_greedy_samples_follow_the_draft_and_keep_prompts():
    target = tiny_target("llama")
    draft = DistillObjective(target, DistillOptions(init="target_layers", num_layers=4)).build_draft()
    prompts = on_policy.prompt_prefixes(_batch())
    assert [p.tolist() for p in prompts] == [[5, 17, 42, 99], [11, 12, 13, 14]]
    prompts[1] = torch.tensor([11, 12])  # different lengths exercise the left padding
    out = on_policy.sample_on_policy(draft, target, prompts, max_new_tokens=6, temperature=0.0)
    assert out.input_ids.shape[0] == 2 and out.input_ids.shape[1] <= 4 + 6
    for b, prompt in enumerate(prompts):
        n = int(out.attention_mask[b].sum())
        assert out.input_ids[b, : len(prompt)].tolist() == prompt.tolist()
        assert out.loss_mask[b, : len(prompt)].sum() == 0 and out.loss_mask[b, len(prompt) : n].all()
        # the draft is an exact copy of the target, so its greedy continuation is the target's
        expected = generate(target, prompt, None, max_new_tokens=6).tokens
        assert out.input_ids[b, len(prompt) : n].tolist() == expected
    assert draft.training  # restored after sampling


def test_on_policy_sampling_is_reproducible_and_mixes_by_fraction():
    target = tiny_target("llama")
    draft = DistillObjective(
        target, DistillOptions(init="config", num_layers=1, hidden_size=16)
    ).build_draft()
    batch = _batch()
    prompts = on_policy.prompt_prefixes(batch)
    a = on_policy.sample_on_policy(draft, target, prompts, 5, 1.0, torch.Generator().manual_seed(0))
    b = on_policy.sample_on_policy(draft, target, prompts, 5, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(a.input_ids, b.input_ids) and a.input_ids.shape[0] == 2 and a.input_ids.shape[1] <= 9
    assert on_policy.mix_on_policy(batch, draft, target, 0.0, 5) is batch
    full = on_policy.mix_on_policy(batch, draft, target, 1.0, 5, generator=torch.Generator().manual_seed(1))
    assert [p.tolist() for p in on_policy.prompt_prefixes(full)] == [p.tolist() for p in prompts]
    assert all(1 <= n <= 5 for n in full.loss_mask.sum(1).tolist())
    chosen = on_policy.on_policy_rows(2, 0.5, torch.Generator().manual_seed(2)).tolist()
    assert len(chosen) == 1  # 0.5 of 2 rows is exactly one, whatever the draw
    half = on_policy.mix_on_policy(batch, draft, target, 0.5, 5, generator=torch.Generator().manual_seed(2))
    kept = 1 - chosen[0]
    assert torch.equal(half.input_ids[kept], batch.input_ids[kept, : half.input_ids.shape[1]])
    assert torch.equal(half.loss_mask[kept], batch.loss_mask[kept, : half.input_ids.shape[1]])
    assert half.input_ids[chosen[0], :4].tolist() == prompts[chosen[0]].tolist()
    assert 1 <= int(half.loss_mask[chosen[0]].sum()) <= 5


def test_on_policy_generator_state_round_trips_for_exact_resume():
    """The on-policy sampler's generator is saved with the checkpoint: a resumed objective draws the
    same rows and continuations as one that never stopped."""
    target = tiny_target("llama", layers=2)
    options = {"num_layers": 1, "on_policy_fraction": 0.5}
    running = DistillObjective(target, DistillOptions(**options))
    running.generator = torch.Generator().manual_seed(7)
    torch.rand(5, generator=running.generator)  # advanced past its seed, as after some steps
    resumed = DistillObjective(target, DistillOptions(**options))
    assert resumed.state_dict() == {}
    resumed.load_state_dict(running.state_dict())
    assert torch.equal(torch.rand(8, generator=resumed.generator), torch.rand(8, generator=running.generator))
