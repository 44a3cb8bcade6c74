"""The one training loop, driven by a tiny objective of its own: a linear next-token head over the
target's last-layer features, distilled from the target's top-k logits. Tiny target, CPU, seconds."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from pydantic.dataclasses import dataclass as pydantic_dataclass
from safetensors.torch import load_file, save_file
from tiny import tiny_model, tiny_tokenizer
from torch import nn

from draftsmith.train.config import load_config
from draftsmith.train.loop import train
from draftsmith.train.module import acceptance_summary, lr_factor
from draftsmith.train.objective import Batch, Objective, Teacher, decoding_walk
from draftsmith.train.objectives.distill import chain_run_lengths
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION


class LinearHead(Objective):
    """Draft = Linear(H, V) over the target's layer-``layer`` output; loss = CE against the target's top-k."""

    kind = "test-linear"
    teacher_topk = 8

    def __init__(self, target, layer: int = -1, token_counts=None):
        n = target.config.num_hidden_layers
        self.capture_layers = (layer % n,)
        self.hidden, self.vocab = target.config.hidden_size, target.vocab_size
        self.token_counts = token_counts
        self.train_losses: list[float] = []

    def build_draft(self) -> nn.Module:
        return nn.Linear(self.hidden, self.vocab)

    def _logits(self, draft, teacher):
        return draft(teacher.features[self.capture_layers[0]].float())  # [B, T, V]

    def loss(self, draft, batch: Batch, teacher: Teacher) -> dict[str, torch.Tensor]:
        logp = self._logits(draft, teacher).log_softmax(-1)
        p = teacher.topk_logits.float().softmax(-1)  # target's distribution over its top-k
        ce = -(p * logp.gather(-1, teacher.topk_ids)).sum(-1)  # [B, T]
        mask = batch.loss_mask[:, 1:].float()  # position t predicts token t + 1
        loss = (ce[:, :-1] * mask).sum() / mask.sum().clamp(min=1)
        if draft.training:
            self.train_losses.append(float(loss.detach()))
        return {"loss": loss, "masked_tokens": mask.sum()}

    @torch.no_grad()
    def chain_lengths(self, draft, batch: Batch, teacher: Teacher, k: int):
        agree = self._logits(draft, teacher).argmax(-1) == teacher.topk_ids[..., 0]  # t predicts t + 1
        valid = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
        valid[:, :-1] = batch.loss_mask[:, 1:].bool() & batch.attention_mask[:, 1:].bool()
        return chain_run_lengths(agree, valid, k), valid & batch.loss_mask.bool()

    def save(self, draft, directory: Path) -> None:
        save_file(draft.state_dict(), str(directory / "model.safetensors"))


@pydantic_dataclass(config=SECTION)
class NoOptions:
    """``draft.options`` of a test head: none."""


register_objective("test-linear", options=NoOptions)(
    lambda target, options, counts: LinearHead(target, token_counts=counts, **options)
)


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target")
    tiny_model("llama", layers=2).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "convs.jsonl"
    with path.open("w") as f:
        for i in range(24):
            turns = [
                {"from": "human", "value": f"count from {i}"},
                {"from": "gpt", "value": f"{i} {i + 1} {i + 2}"},
            ]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


def tau_of_positions(val: dict) -> float:
    """τ from the reported per-position acceptance alone: 1 + Σ_j Π_{i<=j} acc_pos_i (a position no chain
    reached, NaN, adds nothing). A validation whose τ and positions disagree, or shifted by one, fails it."""
    tau, reached, j = 1.0, 1.0, 1
    while f"acc_pos_{j}" in val:
        rate = val[f"acc_pos_{j}"]
        reached *= 0.0 if math.isnan(rate) else rate
        tau, j = tau + reached, j + 1
    return tau


def make_config(target_dir, data, out, *extra: str):
    args = [
        f"--target.spec={target_dir}",
        "--target.device=cpu",
        f"--data.paths=[{data}]",
        "--data.max_length=48",
        "--data.heldout=4",
        "--draft.kind=test-linear",
        "--optim.lr=0.1",
        "--optim.warmup_steps=1",
        "--optim.schedule=constant",
        "--trainer.batch_size=4",
        "--trainer.accelerator=cpu",
        "--trainer.log_every=1",
        f"--output.dir={out}",
        *extra,
    ]
    return load_config(None, args)


QUIET = dict(enable_progress_bar=False)


class Probe(L.Callback):
    """Records what the tests check: start step, optimizer params, draft weights before and after."""

    def __init__(self, crash_at: int | None = None):
        self.crash_at = crash_at

    def on_train_start(self, trainer, module):
        self.start_step = trainer.global_step
        self.draft_before = {k: v.clone() for k, v in module.draft.state_dict().items()}
        self.target_params = list(module.target.model.parameters())
        self.optimized = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
        self.submodules = list(module.modules())
        self.objective = module.objective

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.crash_at is not None and trainer.global_step == self.crash_at:
            raise RuntimeError("simulated crash")


def test_acceptance_summary_by_hand():
    # 2 positions accepted 0 drafts, 1 accepted 1, 1 accepted 2 (k = 2): τ = (0+0+1+2)/4 + 1
    s = acceptance_summary(torch.tensor([2.0, 1.0, 1.0]))
    assert s["tau"] == pytest.approx(1.75)
    assert s["acc_pos_1"] == pytest.approx(2 / 4) and s["acc_pos_2"] == pytest.approx(1 / 2)
    # the loop tests' check of a reported validation: τ agrees with its positions, and not with a shifted copy
    assert tau_of_positions(s) == pytest.approx(s["tau"])
    assert tau_of_positions({**s, "acc_pos_1": s["acc_pos_2"] / 2}) != pytest.approx(s["tau"])
    assert tau_of_positions({"tau": 1.0, "acc_pos_1": 0.0, "acc_pos_2": float("nan")}) == 1.0


def test_decoding_walk_counts_the_steps_decoding_takes():
    # row 0: a chain from t = 0 accepts 2, so decoding drafts next at t = 3 (accepts 0), then at t = 4;
    # t = 1 and t = 2 are never a chain's start, whatever they would accept
    accepted = torch.tensor([[2, 3, 3, 0, 1, 3, 0], [0, 0, 2, 2, 2, 2, 2]])
    starts = torch.tensor([[1, 1, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    # row 0: t=0 (2), t=3 (0), t=4 (1), t=5 is no start, t=6 (0); row 1: t=1 (0), t=2 (2), t=5 (2)
    assert decoding_walk(accepted, starts, k=3).tolist() == [3, 1, 3, 0]
    # every start counted alone would give [3, 1, 5, 2]: more long runs than decoding ever sees
    assert (
        decoding_walk(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool), 2).tolist()
        == [0] * 3
    )


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, warmup=2, max_steps=10, schedule="cosine", min_ratio=0.1) for s in range(11)]
    assert f[0] == 0.5 and f[1] == 1.0 and f[2] == 1.0
    assert all(a >= b for a, b in zip(f[2:], f[3:])) and f[10] == pytest.approx(0.1)


def test_lr_schedule_warmup_then_linear_decay():
    """speculators' schedule: linear warm-up, then a straight line from the peak to lr * min_ratio at max_steps."""
    f = [lr_factor(s, warmup=2, max_steps=10, schedule="linear", min_ratio=0.0) for s in range(11)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[10] == 0.0
    assert [round(b - a, 9) for a, b in zip(f[2:], f[3:])] == [-0.125] * 8  # equal steps down, 8 of them
    assert lr_factor(6, warmup=2, max_steps=10, schedule="linear", min_ratio=0.2) == pytest.approx(0.6)


def test_training_learns_and_leaves_target_alone(tiny_target_dir, conversations, tmp_path, capsys):
    out = tmp_path / "run"
    config = make_config(
        tiny_target_dir, conversations, out, "--trainer.max_steps=12", "--trainer.val_every=6"
    )
    probe = Probe()
    from draftsmith.decode.target import load_target

    target = load_target(str(tiny_target_dir), device="cpu")
    target_before = {k: v.clone() for k, v in target.model.state_dict().items()}
    result = train(config, target=target, callbacks=[probe], **QUIET)

    assert result.steps == 12
    losses = probe.objective.train_losses
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < 0.85 * sum(losses[:3]), losses
    # target: frozen, not a submodule, not optimized, unchanged
    assert not any(p is q for p in probe.optimized for q in probe.target_params)
    assert not any(m is target.model for m in probe.submodules)
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, target_before[k]), k
    # draft changed, checkpoint and export written
    draft_after = load_file(str(result.draft_dir / "model.safetensors"))
    assert any(not torch.equal(draft_after[k], probe.draft_before[k]) for k in draft_after)
    assert result.checkpoint == out / "checkpoints" / "last.ckpt" and result.checkpoint.exists()
    assert not list((out / "checkpoints").glob(".*tmp*"))
    ckpt = torch.load(result.checkpoint, weights_only=False)
    assert ckpt["global_step"] == 12 and all(k.startswith("draft.") for k in ckpt["state_dict"])
    assert (result.draft_dir / "train_config.yaml").exists() and (out / "config.yaml").exists()
    counts = load_file(str(out / "token_counts.safetensors"))["token_counts"]
    assert counts.shape == (target.vocab_size,) and counts.sum() > 0
    # validation metrics reached the CSV log
    metrics = (next((out / "logs").rglob("metrics.csv"))).read_text()
    assert "val/tau" in metrics and "val/acc_pos_1" in metrics and "train/loss" in metrics
    # the trained head agrees with the target on the held-out rows (an untrained one: τ ≈ 1.0)
    assert result.val["tau"] > 1.2 and result.val["tau"] == pytest.approx(tau_of_positions(result.val))
    assert "final val τ" in capsys.readouterr().out


def test_resume_continues_from_last_checkpoint(tiny_target_dir, conversations, tmp_path):
    out = tmp_path / "run"
    args = ("--trainer.max_steps=6", "--trainer.ckpt_every=2", "--trainer.val_every=100")
    config = make_config(tiny_target_dir, conversations, out, *args)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config, callbacks=[Probe(crash_at=5)], **QUIET)
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4
    with pytest.raises(ValueError, match="--resume"):  # refuses to overwrite a run silently
        train(config, **QUIET)

    probe = Probe()
    result = train(config, resume=True, callbacks=[probe], **QUIET)
    assert probe.start_step == 4 and result.steps == 6
    for name, value in saved["state_dict"].items():  # weights restored, not re-initialised
        assert torch.equal(probe.draft_before[name.removeprefix("draft.")], value)
    optimizer = saved["optimizer_states"][0]["state"]
    assert optimizer and all(int(s["step"]) == 4 for s in optimizer.values())
    assert torch.load(result.checkpoint, weights_only=False)["global_step"] == 6


def test_resume_without_checkpoint_is_an_error(tiny_target_dir, conversations, tmp_path):
    config = make_config(tiny_target_dir, conversations, tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(config, resume=True, **QUIET)


def test_eagle3_objective_trains_in_the_loop(tiny_target_dir, conversations, tmp_path):
    """The real EAGLE-3 objective through the same loop: a few steps, exported with save_pretrained."""
    out = tmp_path / "eagle"
    config = make_config(
        tiny_target_dir, conversations, out, "--draft.kind=eagle3", "--trainer.max_steps=2", "--trainer.val_k=2",
        "--draft.options={draft_vocab_size: 64, ttt_steps: 2}", "--optim.lr=1e-3",
    )  # fmt: skip
    result = train(config, **QUIET)
    assert result.steps == 2 and (result.draft_dir / "config.json").exists()
    assert result.val["tau"] == pytest.approx(tau_of_positions(result.val))


def test_eagle3_continues_from_a_saved_head(tiny_target_dir, conversations, tmp_path):
    """draft.options.init_from: the second run starts from the first run's weights and vocabulary map
    (not from counts of its own data), trains them further, and refuses a head of another shape."""
    from draftsmith.drafts.eagle import EagleHead
    from draftsmith.drafts.eagle_parts import build_vocab_map

    base = dict(max_steps="--trainer.max_steps=2", val="--trainer.val_k=2", lr="--optim.lr=1e-3")
    first = train(
        make_config(
            tiny_target_dir, conversations, tmp_path / "a", "--draft.kind=eagle3", *base.values(),
            "--draft.options={draft_vocab_size: 64, ttt_steps: 2}",
        ),
        **QUIET,
    )  # fmt: skip
    start = EagleHead.from_pretrained(first.draft_dir)
    letters = tmp_path / "letters.jsonl"  # other text: counts of its own would give another vocabulary map
    letters.write_text(
        "".join(
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": f"spell {w}"},
                        {"from": "gpt", "value": " ".join(w)},
                    ]
                }
            )
            + "\n"
            for w in ["xylophone", "quiz", "jazz", "kayak", "wombat", "vortex", "hymn", "lynx"] * 2
        )
    )
    probe = Probe()
    options = f"--draft.options={{init_from: {first.draft_dir}, ttt_steps: 3}}"
    config = make_config(
        tiny_target_dir, letters, tmp_path / "b", "--draft.kind=eagle3", *base.values(), options
    )
    second = train(config, callbacks=[probe], **QUIET)
    for name, value in start.state_dict().items():  # weights and the d2t/t2d buffers
        assert torch.equal(probe.draft_before[name], value), name
    after = EagleHead.from_pretrained(second.draft_dir)
    assert torch.equal(after.d2t, start.d2t) and after.config.ttt_steps == 3
    own_counts = load_file(str(tmp_path / "b" / "token_counts.safetensors"))["token_counts"]
    assert not torch.equal(build_vocab_map(own_counts, 64)[0], start.d2t)  # so the map above was kept
    assert any(not torch.equal(after.state_dict()[k], v) for k, v in start.state_dict().items())
    # the copy of the target's embedding stays frozen in the continued run (loading had unfrozen it)
    assert torch.equal(after.embed_tokens.weight, start.embed_tokens.weight)
    assert all(p.requires_grad is False for n, p in probe.submodules[0].named_parameters() if "embed" in n)

    wrong = make_config(
        tiny_target_dir, conversations, tmp_path / "c", "--draft.kind=eagle3", *base.values(),
        f"--draft.options={{init_from: {first.draft_dir}, draft_vocab_size: 32}}",
    )  # fmt: skip
    with pytest.raises(ValueError, match="draft_vocab_size = 64 but the config asks for 32"):
        train(wrong, **QUIET)
    with pytest.raises(FileNotFoundError, match="init_from"):
        train(
            make_config(
                tiny_target_dir, conversations, tmp_path / "d", "--draft.kind=eagle3", *base.values(),
                f"--draft.options={{init_from: {tmp_path / 'missing'}}}",
            ),
            **QUIET,
        )  # fmt: skip


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from draftsmith.files import replace_dir
    from draftsmith.train.infra.checkpoint import AtomicCheckpointIO, last_checkpoint

    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, path)
    assert last_checkpoint(tmp_path) == path

    def dies_midway(obj, f):
        Path(f).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(OSError, match="disk full"):
        AtomicCheckpointIO().save_checkpoint({"global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False)["global_step"] == 1  # the old one, whole
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]

    draft = tmp_path / "draft"
    replace_dir(draft, lambda d: (d / "a.txt").write_text("v1"))

    def fails(d):
        (d / "a.txt").write_text("half")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError):
        replace_dir(draft, fails)
    assert (draft / "a.txt").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "draft"]  # no temp dirs left


def test_distill_objective_trains_in_the_loop(tiny_target_dir, conversations, tmp_path):
    """A layer-subset draft distilled through the same loop; the export is a plain causal-LM draft."""
    from draftsmith.decode.speculative import generate
    from draftsmith.decode.target import load_target
    from draftsmith.drafts import build_drafter

    out = tmp_path / "distill"
    config = make_config(
        tiny_target_dir, conversations, out, "--draft.kind=distill", "--trainer.max_steps=3",
        "--trainer.val_k=2", "--draft.options={init: target_layers, num_layers: 2, loss: jsd}",
    )  # fmt: skip
    result = train(config, **QUIET)
    assert result.steps == 3 and result.val["tau"] == pytest.approx(tau_of_positions(result.val))
    target = load_target(str(tiny_target_dir))
    target.eos_ids = set()
    prompt = torch.arange(10, 30)
    baseline = generate(target, prompt, None, max_new_tokens=12)
    drafted = generate(target, prompt, build_drafter(str(result.draft_dir), target), k=3, max_new_tokens=12)
    assert drafted.tokens == baseline.tokens


def test_on_policy_distillation_in_the_loop(tiny_target_dir, conversations, tmp_path, monkeypatch):
    """DistillSpec's on-policy mode: every batch is the draft's own samples, scored by the target online."""
    from draftsmith.train.objectives import distill

    fractions = []
    real_mix = distill.mix_on_policy

    def spy(*args, **kwargs):
        fractions.append(args[3])
        return real_mix(*args, **kwargs)

    monkeypatch.setattr(distill, "mix_on_policy", spy)
    options = "--draft.options={init: target_layers, num_layers: 2, on_policy_fraction: 1.0, on_policy_max_new_tokens: 6}"
    config = make_config(
        tiny_target_dir, conversations, tmp_path / "op", "--draft.kind=distill", "--trainer.max_steps=2",
        "--trainer.val_k=2", options,
    )  # fmt: skip
    result = train(config, **QUIET)
    assert result.steps == 2 and fractions == [1.0, 1.0]
    offline = make_config(
        tiny_target_dir, conversations, tmp_path / "off", "--draft.kind=distill", "--mode=offline", options
    )
    with pytest.raises(ValueError, match="use mode: online"):
        train(offline, **QUIET)


def test_max_time_stops_early_and_still_exports(tiny_target_dir, conversations, tmp_path, monkeypatch):
    """trainer.max_time ends the fit before max_steps; the final validation, checkpoint and export still run."""
    out = tmp_path / "run"
    config = make_config(
        tiny_target_dir, conversations, out, "--trainer.max_steps=40", "--trainer.max_time=0.0001"
    )
    result = train(config, **QUIET)
    assert 1 <= result.steps < 40
    assert torch.load(result.checkpoint, weights_only=False)["global_step"] == result.steps
    state = json.loads((result.draft_dir / "train_state.json").read_text())
    assert state["step"] == result.steps
    with pytest.raises(ValueError, match=r"trainer.max_time=0: .*greater than 0"):
        make_config(tiny_target_dir, conversations, out, "--trainer.max_time=0")


def test_the_first_screen_holds_draftsmiths_lines_not_lightnings_or_datasets_passes(
    tiny_target_dir, conversations, tmp_path, capsys, caplog
):
    """Before the training bar: one line per data stage (datasets' internal passes, a filter, flattening and
    saving, show no bar of their own) and one line of draftsmith's for the trainer, where Lightning said which
    accelerators exist and which AMP it uses."""
    import datasets

    from draftsmith.train.corpus.tokens import quiet_datasets
    from draftsmith.train.loop import make_trainer

    assert datasets.utils.logging.is_progress_bar_enabled()
    with quiet_datasets():
        assert not datasets.utils.logging.is_progress_bar_enabled()
    assert datasets.utils.logging.is_progress_bar_enabled()  # restored

    config = make_config(tiny_target_dir, conversations, tmp_path / "run", "--trainer.precision=bf16-mixed")
    with caplog.at_level(logging.INFO):
        make_trainer(config, tmp_path / "run")
    out = capsys.readouterr()
    shown = out.out + out.err + caplog.text
    assert "[draftsmith] training on cpu, 1 process, precision bf16-mixed" in out.out
    assert "GPU available" not in shown and "Automatic Mixed Precision" not in shown
    with caplog.at_level(logging.INFO):
        make_trainer(config, tmp_path / "run", enable_progress_bar=False)  # quiet runs keep Lightning's lines
    assert "GPU available" in caplog.text


def test_a_run_shows_one_line_per_data_stage_and_no_loading_bars_before_training(
    tiny_target_dir, tmp_path, capfd
):
    """What ``draftsmith train`` shows before its training bar, as a terminal shows it (the text after each
    carriage return): draftsmith's lines only, one per data stage (read, render + mask, pack, the dataset
    cache) with what each skipped in its own line; no bar of datasets' or of transformers' weight loading, no
    logged notice."""
    data = tmp_path / "convs.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"count {i}"}, {"from": "gpt", "value": f"{i} {i + 1}"}]}
            for i in range(12)]  # fmt: skip
    rows.append({"conversations": [{"from": "gpt", "value": "an answer to nothing"}]})  # skipped on reading
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = make_config(tiny_target_dir, data, tmp_path / "run", "--trainer.max_steps=1", "--data.pack=true")
    capfd.readouterr()
    train(config)
    out, err = capfd.readouterr()

    def shown(text: str) -> list[str]:
        return [s for line in text.split("\n") if (s := line.split("\r")[-1].strip())]

    lines = shown(out)
    before = lines[: next(i for i, line in enumerate(lines) if line.startswith("[draftsmith] training on"))]
    stages = [line.split(":")[1].strip() for line in before]
    assert len(before) == 4 and stages[:3] == ["read", "render + mask", "pack"], before
    assert before[0].startswith("[draftsmith] data: read: 12 conversations")
    assert "skipped 1 conversations" in before[0]  # said in the stage's line, not logged apart
    assert before[1].startswith("[draftsmith] data: render + mask: 12 conversations -> 12 rows")
    assert "rows rendered into the dataset cache" in before[3]
    assert not [line for line in shown(err) if not line.startswith("train")], err
    import transformers

    from draftsmith.train.infra.progress import quiet_loading

    assert transformers.utils.logging.is_progress_bar_enabled()
    with quiet_loading():
        assert not transformers.utils.logging.is_progress_bar_enabled()
    assert transformers.utils.logging.is_progress_bar_enabled()  # restored


def test_the_last_screen_ends_the_bar_before_lightnings_lines_and_drops_what_draftsmith_says(
    tiny_target_dir, conversations, tmp_path, capsys, caplog
):
    """The training bar is closed at its last step (a line Lightning logs as fit stops starts a line of its own),
    the notice that fit stopped at max_steps (draftsmith's summary says the steps) is dropped, and on a machine
    without CUDA DeepSpeed's "Setting accelerator to CPU" too; any other notice of those loggers stays."""
    from types import SimpleNamespace

    from draftsmith.train.infra.progress import StepProgress

    config = make_config(tiny_target_dir, conversations, tmp_path / "run", "--trainer.max_steps=3")
    with caplog.at_level(logging.INFO):
        train(config)
    assert "`Trainer.fit` stopped" not in caplog.text + capsys.readouterr().err
    progress = StepProgress()
    trainer = SimpleNamespace(is_global_zero=True, max_steps=2, global_step=0, progress_bar_metrics={})
    progress.on_train_start(trainer, None)
    for step in (1, 2):
        trainer.global_step = step
        progress.on_train_batch_end(trainer, None, None, None, step - 1)
        assert (progress.bar is None) == (step == 2)  # closed at the last step, before fit's loop ends
    lightning = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO):
        lightning.info("`Trainer.fit` stopped: `max_time=...` reached.")  # a stop worth saying stays
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU ...")
    assert "max_time" in caplog.text
    assert ("Setting accelerator to CPU" in caplog.text) == torch.cuda.is_available()
