"""optim.name muon (train/optimizers.py): Muon on the hidden matrices, AdamW on the rest, as one optimizer that
steps, schedules, clips and resumes as the two would apart; refused where it cannot run."""

from __future__ import annotations

import pytest
import torch
from test_loop import QUIET, Probe, conversations, make_config, tiny_target_dir  # noqa: F401  (fixtures)
from torch import nn

from draftsmith.train import optimizers
from draftsmith.train.loop import train
from draftsmith.train.optimizers import MuonAdamW, adamw_groups, build_optimizer, muon_split
from draftsmith.train.schema import OptimConfig


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(11, 6)
        self.fc = nn.Linear(12, 6)
        self.layer = nn.Linear(6, 6, bias=False)
        self.gate = nn.Parameter(torch.randn(1, 6))  # a [1, N] "matrix": a vector to Muon
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        h = self.layer(self.fc(torch.cat([h, h * self.gate], -1)))
        return self.lm_head(self.norm(h))


def loss_of(model, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 11, (4, 5), generator=g)
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())


def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_readouts_vectors_and_norms():
    model = Head()
    muon, rest = muon_split(model, list(model.named_parameters()))
    assert {id(p) for p in muon} == {id(model.fc.weight), id(model.layer.weight)}
    assert {id(p) for p in rest} == {id(p) for n, p in model.named_parameters()} - {id(p) for p in muon}


def test_it_steps_schedules_and_resumes_exactly_as_muon_and_adamw_apart(monkeypatch):
    monkeypatch.setattr(optimizers, "bf16_matmul_is_slow", lambda params: False)  # torch's Muon, unchanged
    o = OptimConfig(name="muon", lr=1e-2, muon_lr=2e-2, weight_decay=0.01)

    def apart():
        model = Head()
        muon, rest = muon_split(model, list(model.named_parameters()))
        parts = [torch.optim.Muon(muon, lr=2e-2, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"),
                 torch.optim.AdamW(adamw_groups(rest, 0.01), lr=1e-2, betas=o.betas)]  # fmt: skip
        schedules = [torch.optim.lr_scheduler.LambdaLR(p, lambda s: 1 / (1 + s)) for p in parts]
        for step in range(6):
            loss_of(model, step).backward()
            for p, s in zip(parts, schedules):
                p.step(), p.zero_grad(), s.step()
        return model

    def together(stop_at=None):
        model = Head()
        optimizer = build_optimizer(model, list(model.named_parameters()), o)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
        for step in range(6):
            if step == stop_at:  # a resume: a new optimizer and schedule from the saved states
                saved = optimizer.state_dict(), schedule.state_dict()
                optimizer = build_optimizer(model, list(model.named_parameters()), o)
                schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
                optimizer.load_state_dict(saved[0]), schedule.load_state_dict(saved[1])
            optimizer.zero_grad()
            optimizer.step(lambda step=step: loss_of(model, step).backward())
            schedule.step()
        return model

    reference = apart().state_dict()
    for stop_at in (None, 3):
        got = together(stop_at).state_dict()
        assert all(torch.equal(got[k], reference[k]) for k in reference), stop_at
    assert not torch.equal(reference["layer.weight"], Head().layer.weight)


def test_where_bf16_products_are_slow_muon_orthogonalises_in_float32_rounded_as_bf16(monkeypatch):
    """A CPU without bf16 matrix instructions: Muon's Newton-Schulz products run in float32, each result rounded
    to bf16, which is torch's bf16 iteration up to the order of summation; torch's own is back after the step."""
    import torch.optim._muon as torch_muon

    own = torch_muon._zeropower_via_newtonschulz
    torch.manual_seed(0)
    for shape in ((24, 40), (40, 24)):  # wide, and tall (orthogonalised transposed)
        grad = torch.randn(shape)
        reference = own(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        got = optimizers.newton_schulz_bf16(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert got.dtype == torch.bfloat16 and got.shape == grad.shape
        assert (got.float() - reference).abs().max() <= 0.04 * reference.abs().max()  # as far as float32 is
        wrong = optimizers.newton_schulz_bf16(grad, (3.4445, -4.7750, 2.0315), 1, 1e-7)  # one step: far off
        assert (wrong.float() - reference).abs().max() > 0.3 * reference.abs().max()

    calls, emulated = [], optimizers.newton_schulz_bf16

    def spy(grad, *args):
        calls.append(grad.shape)
        return emulated(grad, *args)

    monkeypatch.setattr(optimizers, "newton_schulz_bf16", spy)
    for slow in (True, False):
        monkeypatch.setattr(optimizers, "bf16_matmul_is_slow", lambda params, slow=slow: slow)
        model, calls[:] = Head(), []
        optimizer = build_optimizer(model, list(model.named_parameters()), OptimConfig(name="muon", lr=1e-2))
        loss_of(model, 0).backward()
        optimizer.step()
        assert sorted(calls) == (sorted([model.fc.weight.shape, model.layer.weight.shape]) if slow else [])
        assert torch_muon._zeropower_via_newtonschulz is own  # restored


def test_a_checkpoint_of_another_optimizer_and_a_draft_without_matrices_are_refused():
    model = Head()
    adamw = build_optimizer(model, list(model.named_parameters()), OptimConfig())
    muon = build_optimizer(model, list(model.named_parameters()), OptimConfig(name="muon"))
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, MuonAdamW)
    with pytest.raises(ValueError, match="another optim.name"):
        muon.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="no hidden weight matrix for Muon.*optim.name adamw"):
        build_optimizer(model, [("norm.weight", model.norm.weight)], OptimConfig(name="muon"))


def test_muon_is_refused_with_a_sharded_strategy(tiny_target_dir, conversations, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="optim.name muon with trainer.strategy fsdp.*ddp"):
        make_config(tiny_target_dir, conversations, tmp_path, "--optim.name=muon", "--trainer.strategy=fsdp")


def test_an_eagle3_head_trains_with_muon_in_the_loop_and_resumes(tiny_target_dir, conversations, tmp_path):  # noqa: F811
    out = tmp_path / "muon"
    config = make_config(
        tiny_target_dir, conversations, out, "--draft.kind=eagle3", "--trainer.max_steps=4", "--trainer.val_k=2",
        "--trainer.ckpt_every=2", "--trainer.val_every=100", "--draft.options={draft_vocab_size: 64, ttt_steps: 2}",
        "--optim.lr=1e-3", "--optim.name=muon",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config, callbacks=[Probe(crash_at=3)], **QUIET)
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    state = saved["optimizer_states"][0]
    assert saved["global_step"] == 2 and state["muon"]["state"] and state["adamw"]["state"]
    probe = Probe()
    result = train(config, resume=True, callbacks=[probe], **QUIET)
    assert probe.start_step == 2 and result.steps == 4
    for name, value in saved["state_dict"].items():
        assert torch.equal(probe.draft_before[name.removeprefix("draft.")], value)
