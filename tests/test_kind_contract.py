"""The contract every trainable kind keeps, one test for all: a kind is in it by registering an objective.

On a tiny random target, with the kind's default options (its options class's defaults must suit a
tiny target), the objective builds a draft, trains on the target's own greedy continuations through its
loss, and saves a checkpoint that decodes the target's own tokens, some of its drafts accepted; exported
``--to hf``, the folder verifies, reloads and decodes the same tokens with the same acceptances.
"""

from __future__ import annotations

import pytest
import torch
from test_eagle import self_distilled_batch
from tiny import tiny_target

from draftsmith.decode.speculative import generate
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import build_drafter, kind_names
from draftsmith.export import export_checkpoint, verify_export
from draftsmith.train.registry import build_objective, objective_kinds
from draftsmith.train.teacher import compute_teacher

STEPS, LR, K, NEW_TOKENS = 30, 1e-2, 3, 16


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4)


@pytest.fixture(scope="module")
def batch(target):
    return self_distilled_batch(target)


def train_steps(objective, batch, target) -> tuple[torch.nn.Module, list[float]]:
    """``STEPS`` AdamW steps on one batch through the objective's own loss, the teacher as the loop's."""
    torch.manual_seed(0)
    draft = objective.build_draft().train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        rows = objective.prepare_batch(draft, batch)
        teacher = compute_teacher(target, rows, objective.capture_layers, objective.teacher_topk)
        loss = objective.loss(draft, rows, teacher)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return draft.eval(), losses


def draft_kinds_that_train() -> list[str]:
    """The registry's kinds with an objective; objectives other tests register for no kind (``test-linear``
    of test_loop, imported before this module is collected) are not kinds and keep no contract."""
    return [kind for kind in objective_kinds() if kind in kind_names()]


@pytest.mark.parametrize("kind", draft_kinds_that_train())
def test_a_kind_trains_decodes_losslessly_and_exports_to_hf_unchanged(kind, target, batch, tmp_path):
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    objective = build_objective(kind, target, {}, counts)
    draft, losses = train_steps(objective, batch, target)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses

    run = tmp_path / "run"
    objective.save(draft, run / "draft")
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=NEW_TOKENS).tokens
    saved = generate(target, prompt, build_drafter(str(run), target), k=K, max_new_tokens=NEW_TOKENS)
    assert saved.tokens == reference
    assert sum(saved.accepted) > 0  # trained on this very continuation: the decoder uses what it learnt

    out = export_checkpoint(locate_checkpoint(str(run)), "hf", tmp_path / "hf")
    assert verify_export(out, "hf")
    exported = generate(target, prompt, build_drafter(str(out), target), k=K, max_new_tokens=NEW_TOKENS)
    assert exported.tokens == reference and exported.accepted == saved.accepted
