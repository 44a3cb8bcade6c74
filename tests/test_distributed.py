"""Several processes on the CPU (DDP over gloo), launched by Lightning from a subprocess so pytest itself
is never forked: the same loss curve as one process with the same global batch, and a checkpoint
written by 2 processes that resumes in 1; a short offline run whose cache every rank agrees on, under
Lightning's launcher as under torchrun. Plus the strategy choice, the ranks planned before launch, and
their errors."""

from __future__ import annotations

import csv
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_loop import QUIET, make_config, tiny_target_dir  # noqa: F401 (fixture)
from test_resume import WORKER, final_weights, run_worker, uniform_conversations  # noqa: F401 (fixture)

from draftsmith.train.config import load_config
from draftsmith.train.infra.distributed import build_strategy, capture_rank, env_rank, planned_rank
from draftsmith.train.loop import train
from draftsmith.train.schema import TrainerConfig

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


@pytest.mark.slow
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


@pytest.mark.slow
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


# 20 training rows; 2 steps of 2 ranks x 2 rows read 8 of them: the cache holds 4 shards of 2, not all 10
SHORT_OFFLINE = ("--mode=offline", "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.batch_size=2",
                 "--trainer.max_steps=2", "--trainer.val_every=100", "--cache.examples_per_shard=2")  # fmt: skip


def run_ranks(*args: str, timeout: float, torchrun: bool = False) -> subprocess.CompletedProcess:
    """tests/train_worker.py on 2 ranks (started by Lightning's launcher, or all at once by torchrun), in a
    session of its own that is killed whole when it outlives ``timeout``: a hang fails the test and leaves
    no rank waiting behind it."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(
        [*(launcher if torchrun else [sys.executable]), str(WORKER), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"2 ranks still running after {timeout:g} s (hung):\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def short_offline_run(tiny_target_dir, uniform_conversations, tmp_path_factory):  # noqa: F811
    """A short offline run on 2 ranks started by Lightning's own launcher: rank 1 exists only from fit on."""
    root = tmp_path_factory.mktemp("short_offline")
    proc = run_ranks(tiny_target_dir, uniform_conversations, root / "run", *SHORT_OFFLINE,
                     f"--cache.dir={root / 'cache'}", timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root


@pytest.mark.slow
def test_lightnings_launcher_caches_a_short_offline_run_that_every_rank_agrees_on(
    short_offline_run,
    tiny_target_dir,
    uniform_conversations,
    tmp_path,  # noqa: F811
):
    cache = short_offline_run / "cache" / "train"
    shards = {path.name: path.stat().st_mtime_ns for path in cache.glob("shard-*.safetensors")}
    assert len(shards) == 4  # the 8 rows 2 ranks read, not the 4 one rank would
    again = run_ranks(tiny_target_dir, uniform_conversations, tmp_path / "again", *SHORT_OFFLINE,
                      f"--cache.dir={short_offline_run / 'cache'}", "--no-target-layers", timeout=240)  # fmt: skip
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    both = again.stdout + again.stderr
    assert "is complete" in again.stdout  # ... on every rank: none loaded the target's layers to capture
    assert all(f"rank {rank}: target layers on meta" in both for rank in (0, 1)), both[-3000:]
    assert {path.name: path.stat().st_mtime_ns for path in cache.glob("shard-*.safetensors")} == shards
    ours, theirs = logged_losses(tmp_path / "again"), logged_losses(short_offline_run / "run")
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for step, loss in theirs.items():
        assert ours[step] == pytest.approx(loss, abs=1e-6, rel=0), (step, ours, theirs)


@pytest.mark.slow
def test_a_short_offline_run_trains_the_same_under_torchrun(
    short_offline_run,
    tiny_target_dir,
    uniform_conversations,
    tmp_path,  # noqa: F811
):
    """Every rank alive from the start and capturing its own shards: the same rows, the same losses."""
    proc = run_ranks(tiny_target_dir, uniform_conversations, tmp_path / "run", *SHORT_OFFLINE,
                     f"--cache.dir={tmp_path / 'cache'}", timeout=240, torchrun=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "over 2 ranks" in proc.stdout  # the capture was split, unlike under Lightning's launcher
    assert len(list((tmp_path / "cache" / "train").glob("shard-*.safetensors"))) == 4
    ours, theirs = logged_losses(tmp_path / "run"), logged_losses(short_offline_run / "run")
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for step, loss in theirs.items():
        assert ours[step] == pytest.approx(loss, abs=1e-6, rel=0), (step, ours, theirs)


# The sharded engines on the same 2 gloo ranks as ddp_run. Lightning refuses both on the CPU (where, in
# train/infra/distributed.py): ZeRO runs through Lightning's DeepSpeed strategy on DeepSpeed's CPU accelerator, FSDP
# as torch's FSDP2 under Lightning's ModelParallelStrategy. Each is one launch of 4 steps, then a resume.
SHARDED = ("deepspeed_stage_1", "deepspeed_stage_2", "fsdp")
LIKE_DDP = dict(rel=1e-5, abs=1e-6)
"""How close a sharded engine's losses and weights come to DDP's. Measured on the 2-core Xeon (float32,
deterministic algorithms, one thread a rank): see the commit and docs/TRAINING.md."""


def draft_weights(out: Path) -> dict[str, torch.Tensor]:
    """The exported draft's weights: the same file whatever the engine's checkpoint format."""
    from safetensors.torch import load_file

    return load_file(str(out / "draft" / "model.safetensors"))


@pytest.fixture(scope="module", params=SHARDED)
def sharded_run(request, tiny_target_dir, uniform_conversations, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp(request.param) / "run"
    proc = run_ranks(tiny_target_dir, uniform_conversations, out, *COMMON, f"--trainer.strategy={request.param}",
                     "--trainer.devices=2", "--trainer.batch_size=2", timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return request.param, out


@pytest.mark.slow
def test_sharded_engines_train_as_ddp(sharded_run, ddp_run):
    strategy, out = sharded_run
    ours, ddp = logged_losses(out), logged_losses(ddp_run)
    assert sorted(ours) == sorted(ddp) == [0, 1, 2, 3]
    for step, loss in ddp.items():
        assert ours[step] == pytest.approx(loss, **LIKE_DDP), (strategy, step, ours, ddp)
    for name, value in draft_weights(ddp_run).items():
        torch.testing.assert_close(
            draft_weights(out)[name], value, rtol=LIKE_DDP["rel"], atol=LIKE_DDP["abs"]
        )
    last = out / "checkpoints" / "last.ckpt"
    assert last.is_dir() if strategy.startswith("deepspeed") else last.is_file()  # ZeRO: a DeepSpeed folder


@pytest.mark.slow
def test_sharded_checkpoint_resumes(sharded_run, tiny_target_dir, uniform_conversations, tmp_path):  # noqa: F811
    """Resumed from the last checkpoint (step 4) on 2 ranks with the same engine, steps 4 and 5 are a straight
    run's (one process, same global batch)."""
    strategy, out = sharded_run
    resumed = tmp_path / "resumed"
    __import__("shutil").copytree(out, resumed)
    longer = (*COMMON, "--trainer.max_steps=6")
    proc = run_ranks(tiny_target_dir, uniform_conversations, resumed, *longer, f"--trainer.strategy={strategy}",
                     "--trainer.devices=2", "--trainer.batch_size=2", "--resume", timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    straight = tmp_path / "straight"
    train(
        make_config(tiny_target_dir, uniform_conversations, straight, *longer, "--trainer.batch_size=4"),
        **QUIET,
    )
    both, one = logged_losses(resumed), logged_losses(straight)
    assert sorted(both) == sorted(one) == list(range(6))
    for step in (4, 5):
        assert both[step] == pytest.approx(one[step], **LIKE_DDP), (strategy, step, both, one)
    for name, value in draft_weights(straight).items():
        torch.testing.assert_close(
            draft_weights(resumed)[name], value, rtol=LIKE_DDP["rel"], atol=LIKE_DDP["abs"]
        )


def test_deepspeed_without_deepspeed_names_the_extra(monkeypatch):
    import draftsmith.train.infra.distributed as distributed

    monkeypatch.setattr(distributed, "deepspeed_available", lambda: False)
    for preset in ("deepspeed_zero2", "deepspeed_zero3"):
        config = load_config(None, ["--data.paths=[a.jsonl]"], presets=[preset])
        assert config.trainer.strategy.startswith("deepspeed_stage_")
        with pytest.raises(ImportError, match=r"pip install 'draftsmith\[deepspeed\]'"):
            build_strategy(config.trainer)


def test_cli_reports_missing_deepspeed(monkeypatch, capsys):
    import draftsmith.train.infra.distributed as distributed
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


LAUNCH_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID",
               "SLURM_NTASKS", "SLURM_JOB_NAME", "LOCAL_WORLD_SIZE")  # fmt: skip


def launched_by(monkeypatch, env: dict[str, str]) -> None:
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


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
    launched_by(monkeypatch, env)
    assert env_rank() == want


LIGHTNING_CHILD = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}  # what its launcher gives rank 1


@pytest.mark.parametrize(
    "devices, nodes, env, planned, capture",
    [
        (2, 1, {}, (0, 0, 2), (0, 1)),  # Lightning's launcher, before fit: rank 1 does not exist yet
        (2, 1, LIGHTNING_CHILD, (1, 1, 2), (1, 2)),  # ... and the rank it starts at fit: the same world
        ("[0, 1, 2]", 1, {}, (0, 0, 3), (0, 1)),
        ("0,1", 1, {}, (0, 0, 2), (0, 1)),
        ("auto", 1, {}, (0, 0, 1), (0, 1)),  # on the CPU: one process
        (1, 1, {}, (0, 0, 1), (0, 1)),
        (4, 2, {"NODE_RANK": "1"}, (4, 0, 8), (1, 2)),  # second node's first process, before fit
        (4, 2, {"LOCAL_RANK": "3", "NODE_RANK": "1", "WORLD_SIZE": "8"}, (7, 3, 8), (7, 8)),  # ... its rank 3
        (2, 1, {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 1, 2), (1, 2)),  # torchrun
    ],
)
def test_the_planned_world_is_the_same_before_and_after_lightning_starts_the_ranks(
    monkeypatch, devices, nodes, env, planned, capture
):
    launched_by(monkeypatch, env)
    t = dataclasses.replace(
        TrainerConfig(), accelerator="cpu", strategy="ddp", devices=devices, num_nodes=nodes
    )
    assert planned_rank(t) == planned
    assert capture_rank(t) == capture


def test_devices_that_are_no_count_are_named(monkeypatch):
    launched_by(monkeypatch, {})
    t = dataclasses.replace(TrainerConfig(), accelerator="cpu", devices="two")
    with pytest.raises(ValueError, match=r"trainer.devices='two'.*8, '\[0, 1\]' or auto"):
        planned_rank(t)


def test_large_target_options_load_bf16_frozen_in_place(tiny_target_dir):  # noqa: F811
    from draftsmith.decode.target import load_target
    from draftsmith.train.infra.distributed import target_device

    target = load_target(str(tiny_target_dir), device="cpu", dtype="bfloat16", device_map="device")
    params = list(target.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16} and not any(p.requires_grad for p in params)
    assert {p.device.type for p in params} == {"cpu"} and not target.model.training
    assert not any(p.is_meta for p in params)  # built on the meta device, then filled: nothing left empty
    assert target_device("cpu") == "cpu"


def test_activation_checkpointing_is_applied_or_refused():
    from tiny import tiny_model

    from draftsmith.train.infra.distributed import enable_activation_checkpointing

    draft = tiny_model("llama", layers=2).train()
    enable_activation_checkpointing(draft, "distill")
    assert draft.is_gradient_checkpointing
    draft(input_ids=torch.arange(8)[None]).logits.sum().backward()  # recomputes in backward without error
    with pytest.raises(ValueError, match="activation_checkpointing: false"):
        enable_activation_checkpointing(torch.nn.Linear(4, 4), "test-linear")
