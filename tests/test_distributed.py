"""Several processes on the CPU (DDP over gloo), launched by Lightning from a subprocess so pytest itself
is never forked: the same loss curve as one process with the same global batch, and a checkpoint
written by 2 processes that resumes in 1. Plus the strategy choice and its errors."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from test_loop import QUIET, make_config, tiny_target_dir  # noqa: F401 (fixture)
from test_resume import final_weights, run_worker, uniform_conversations  # noqa: F401 (fixture)

from draftsmith.train.config import load_config
from draftsmith.train.distributed import build_strategy, env_rank
from draftsmith.train.loop import train

# 20 training rows; global batch 4 (2 ranks x 2, or 1 x 4): 5 steps an epoch.
COMMON = ("--trainer.max_steps=4", "--trainer.ckpt_every=2", "--trainer.val_every=100", "--optim.lr=0.05")


def logged_losses(out: Path) -> dict[int, float]:
    """train/loss per optimizer step from the CSV log (the mean over ranks, see DraftModule.training_step)."""
    losses = {}
    for path in sorted(out.joinpath("logs").glob("version_*/metrics.csv")):  # a resume logs a new version
        rows = csv.DictReader(path.open())
        losses.update({int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")})
    return losses


@pytest.fixture(scope="module")
def ddp_run(tiny_target_dir, uniform_conversations, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("ddp") / "run"
    proc = run_worker(
        tiny_target_dir, uniform_conversations, out, *COMMON,
        "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.batch_size=2", timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_two_process_ddp_matches_one_process(ddp_run, tiny_target_dir, uniform_conversations, tmp_path):  # noqa: F811
    single = tmp_path / "single"
    train(
        make_config(tiny_target_dir, uniform_conversations, single, *COMMON, "--trainer.batch_size=4"),
        **QUIET,
    )
    ddp, one = logged_losses(ddp_run), logged_losses(single)
    assert sorted(ddp) == sorted(one) == [0, 1, 2, 3]
    assert one[3] < one[0]  # it learns, so the comparison is not between flat lines
    for step in one:
        assert ddp[step] == pytest.approx(one[step], rel=1e-4), (step, ddp, one)
    for name, value in final_weights(single).items():
        torch.testing.assert_close(final_weights(ddp_run)[name], value, rtol=1e-4, atol=1e-6)


def test_two_process_checkpoint_resumes_in_one(ddp_run, tiny_target_dir, uniform_conversations, tmp_path):  # noqa: F811
    saved = torch.load(ddp_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 4 and saved["draftsmith_resume"]["world_size"] == 2
    assert saved["draftsmith_resume"]["data"]["consumed"] == 16  # 4 steps x 4 rows

    longer = (*COMMON, "--trainer.max_steps=7", "--trainer.batch_size=4")
    resumed = tmp_path / "resumed"
    __import__("shutil").copytree(ddp_run, resumed)
    result = train(
        make_config(tiny_target_dir, uniform_conversations, resumed, *longer), resume=True, **QUIET
    )
    straight = tmp_path / "straight"
    train(make_config(tiny_target_dir, uniform_conversations, straight, *longer), **QUIET)
    assert result.steps == 7
    both, one = logged_losses(resumed), logged_losses(straight)
    for step in (4, 5, 6):  # the rest of epoch 0 (one batch), then epoch 1, as the straight run saw them
        assert both[step] == pytest.approx(one[step], rel=1e-4), (step, both, one)
    for name, value in final_weights(straight).items():
        torch.testing.assert_close(final_weights(resumed)[name], value, rtol=1e-4, atol=1e-6)


def test_deepspeed_without_deepspeed_names_the_extra(monkeypatch):
    import draftsmith.train.distributed as distributed

    monkeypatch.setattr(distributed, "deepspeed_available", lambda: False)
    for preset in ("deepspeed_zero2", "deepspeed_zero3"):
        config = load_config(None, ["--data.paths=[a.jsonl]"], presets=[preset])
        assert config.trainer.strategy.startswith("deepspeed_stage_")
        with pytest.raises(ImportError, match=r"pip install 'draftsmith\[deepspeed\]'"):
            build_strategy(config.trainer)


def test_cli_reports_missing_deepspeed(monkeypatch, capsys):
    import draftsmith.train.distributed as distributed
    from draftsmith.cli import main

    monkeypatch.setattr(distributed, "deepspeed_available", lambda: False)
    recipe = Path(__file__).resolve().parents[1] / "configs" / "debug_eagle3.yaml"
    monkeypatch.setattr(
        "draftsmith.train.loop.load_target", lambda *a, **k: pytest.fail("loaded a target first")
    )
    assert main(["train", str(recipe), "--preset", "deepspeed_zero3", "--trainer.max_steps=1"]) == 2
    assert "draftsmith[deepspeed]" in capsys.readouterr().err


def test_strategies_resolve():
    config = load_config(None, ["--data.paths=[a.jsonl]"], presets=["fsdp"])
    strategy = build_strategy(config.trainer)
    assert type(strategy).__name__ == "FSDPStrategy"
    assert build_strategy(load_config(None, ["--data.paths=[a.jsonl]"], presets=["ddp"]).trainer) == "ddp"


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, (0, 0, 1)),
        ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (5, 1, 8)),  # torchrun
        ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, (1, 1, 2)),  # Lightning's launcher
        (
            {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": "train"},
            (3, 1, 4),
        ),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash"}, (0, 0, 1)),  # salloc shell
    ],
)
def test_rank_from_the_launchers_environment(monkeypatch, env, want):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
                "SLURM_JOB_NAME", "LOCAL_WORLD_SIZE"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert env_rank() == want


def test_large_target_options_load_bf16_frozen_in_place(tiny_target_dir):  # noqa: F811
    from draftsmith.decode.target import load_target
    from draftsmith.train.distributed import target_device

    target = load_target(str(tiny_target_dir), device="cpu", dtype="bfloat16", device_map="device")
    params = list(target.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16} and not any(p.requires_grad for p in params)
    assert {p.device.type for p in params} == {"cpu"} and not target.model.training
    assert not any(p.is_meta for p in params)  # built on the meta device, then filled: nothing left empty
    assert target_device("cpu") == "cpu"


def test_activation_checkpointing_is_applied_or_refused():
    from tiny import tiny_model

    from draftsmith.train.distributed import enable_activation_checkpointing

    draft = tiny_model("llama", layers=2).train()
    enable_activation_checkpointing(draft, "distill")
    assert draft.is_gradient_checkpointing
    draft(input_ids=torch.arange(8)[None]).logits.sum().backward()  # recomputes in backward without error
    with pytest.raises(ValueError, match="activation_checkpointing: false"):
        enable_activation_checkpointing(torch.nn.Linear(4, 4), "test-linear")
