"""Exact resume: a run SIGKILLed after a checkpoint and resumed ends with the same weights, bit for bit,
as a run that went straight through (CPU, deterministic algorithms, one thread). Plus the resumable
sampler's order and position on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import train_worker  # noqa: F401 (registers test-noisy)
from test_loop import QUIET, make_config, tiny_target_dir  # noqa: F401 (fixture)

from draftsmith.train.infra.checkpoint import last_checkpoint
from draftsmith.train.loop import train
from draftsmith.train.sampler import ResumableSampler

WORKER = Path(__file__).parent / "train_worker.py"


@pytest.fixture(scope="module")
def uniform_conversations(tmp_path_factory) -> Path:
    """24 conversations of identical length (two-digit numbers): every row has as many loss tokens."""
    path = tmp_path_factory.mktemp("data") / "uniform.jsonl"
    with path.open("w") as f:
        for i in range(10, 34):
            turns = [
                {"from": "human", "value": f"count from {i}"},
                {"from": "gpt", "value": f"{i} {i + 1} {i + 2}"},
            ]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return path


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def run_worker(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    return subprocess.run(
        [sys.executable, str(WORKER), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(last_checkpoint(out), weights_only=True)["state_dict"]


# 20 training rows, 2 per micro-batch, 2 micro-batches per step: 5 steps an epoch. The run is killed
# after step 4 (last checkpoint: step 3, mid-epoch) and resumed across the epoch boundary to step 8.
RUN = ("--draft.kind=test-noisy", "--trainer.batch_size=2", "--trainer.grad_accum=2", "--trainer.max_steps=8",
       "--trainer.ckpt_every=3", "--trainer.val_every=4")  # fmt: skip


def test_sigkill_resume_equals_straight_run(tiny_target_dir, uniform_conversations, tmp_path, deterministic):  # noqa: F811
    straight = tmp_path / "straight"
    train(make_config(tiny_target_dir, uniform_conversations, straight, *RUN), **QUIET)

    killed = tmp_path / "killed"
    proc = run_worker(tiny_target_dir, uniform_conversations, killed, *RUN, "--kill-at-step", "4")
    assert proc.returncode == -9, proc.stderr[-3000:]  # died by SIGKILL, not by finishing or raising
    saved = torch.load(last_checkpoint(killed), weights_only=True)
    assert saved["global_step"] == 3
    position = {"epoch": 0, "consumed": 12, "seed": 0, "world_size": 1}  # 6 micro-batches x 2 rows
    assert saved["draftsmith_resume"]["data"] == position
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [position]  # Lightning's copy
    assert len(saved["draftsmith_resume"]["ranks"]) == 1
    # a checkpoint write cut short by the kill: never picked up, cleaned away on resume
    partial = killed / "checkpoints" / ".last.ckpt.tmp-99999"
    partial.write_bytes(b"\x80\x02 half a pickle")

    result = train(make_config(tiny_target_dir, uniform_conversations, killed, *RUN), resume=True, **QUIET)
    assert result.steps == 8 and not partial.exists()
    want, got = final_weights(straight), final_weights(killed)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert not torch.equal(want["draft.1.weight"], saved["state_dict"]["draft.1.weight"])  # it did train on


def test_a_partial_checkpoint_alone_is_not_resumable(tiny_target_dir, uniform_conversations, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / ".last.ckpt.tmp-4242").write_bytes(b"partial")
    assert last_checkpoint(out) is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(make_config(tiny_target_dir, uniform_conversations, out), resume=True, **QUIET)


def epoch_rows(sampler: ResumableSampler) -> list[int]:
    return list(sampler)


def test_sampler_order_is_fixed_by_seed_and_epoch_and_resumes():
    a = ResumableSampler(10, batch_size=3, seed=1, rank=0, world_size=1)
    first = epoch_rows(a)
    assert len(first) == len(a) == 9 and len(set(first)) == 9  # one row left out: not a whole batch
    a.advance(3)  # the epoch's last batch taken: the sampler moves on by itself
    assert a.state_dict()["epoch"] == 1 and a.consumed == 0
    second = epoch_rows(a)
    assert (
        second != first and len(set(second)) == 9 and set(second) != set(first)
    )  # reshuffled, another left out
    b = ResumableSampler(10, batch_size=3, seed=1, rank=0, world_size=1)
    b.advance(5)  # 3 batches of epoch 0, 2 of epoch 1
    c = ResumableSampler(10, batch_size=3, seed=1, rank=0, world_size=1)
    c.load_state_dict(b.state_dict())
    assert epoch_rows(c) == second[6:] and len(c) == 9
    assert (
        epoch_rows(ResumableSampler(10, batch_size=3, seed=1, rank=0, world_size=1)) == first
    )  # by seed alone
    with pytest.raises(ValueError, match="same trainer.seed"):
        ResumableSampler(10, batch_size=3, seed=2).load_state_dict(b.state_dict())


def test_sampler_global_batches_are_the_same_on_any_world_size():
    one = epoch_rows(ResumableSampler(21, batch_size=4, seed=0, rank=0, world_size=1))
    ranks = [epoch_rows(ResumableSampler(21, batch_size=2, seed=0, rank=r, world_size=2)) for r in (0, 1)]
    assert len(one) == 20 and len(ranks[0]) == len(ranks[1]) == 10
    for step in range(5):  # global batch k: the same four rows either way
        assert sorted(one[4 * step : 4 * step + 4]) == sorted(
            ranks[0][2 * step : 2 * step + 2] + ranks[1][2 * step : 2 * step + 2]
        )
    # two ranks after 3 steps -> one rank with the same global batch: the rest of the epoch, once each
    two = ResumableSampler(21, batch_size=2, seed=0, rank=0, world_size=2)
    two.advance(3)
    resumed = ResumableSampler(21, batch_size=4, seed=0, rank=0, world_size=1)
    resumed.load_state_dict(two.state_dict())
    assert epoch_rows(resumed) == one[12:]
    with pytest.raises(ValueError, match="do not fill one batch"):
        len(ResumableSampler(3, batch_size=2, rank=0, world_size=2))


def test_checkpoints_leave_out_the_frozen_target_weights_and_refuse_another_target(
    tiny_target_dir,
    uniform_conversations,
    tmp_path,  # noqa: F811
):
    from tiny import tiny_model, tiny_tokenizer

    out = tmp_path / "run"
    eagle = ("--draft.kind=eagle3", "--draft.options.ttt_steps=1", "--draft.options.draft_vocab_size=64",
             "--trainer.max_steps=2", "--trainer.ckpt_every=1", "--trainer.val_every=2")  # fmt: skip
    train(make_config(tiny_target_dir, uniform_conversations, out, *eagle), **QUIET)
    saved = torch.load(last_checkpoint(out), weights_only=True)
    assert "draft.embed_tokens.weight" not in saved["state_dict"]  # the target's own embedding, frozen
    assert "draft.fuse_features.weight" in saved["state_dict"]  # what was trained stays
    frozen = saved["draftsmith_frozen"]
    assert frozen["target"] == str(tiny_target_dir)
    assert frozen["tensors"]["draft.embed_tokens.weight"]["shape"] == [259, 32]
    assert "embed_tokens.weight" in safe_open_keys(
        out / "draft"
    )  # the exported draft keeps it: engines read it

    resumed = train(make_config(tiny_target_dir, uniform_conversations, out, *eagle, "--trainer.max_steps=3"),
                    resume=True, **QUIET)  # fmt: skip
    assert resumed.steps == 3  # the embedding came back from the target, and matched

    other = tmp_path / "other_target"  # the same shapes, other weights
    tiny_model("llama", seed=1, layers=2).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    config = make_config(other, uniform_conversations, out, *eagle, "--trainer.max_steps=4")
    recipe = (out / "config.yaml").read_text()
    with pytest.raises(
        ValueError, match=rf"trained for target '{tiny_target_dir}'.*--target.spec={tiny_target_dir}"
    ):
        train(config, resume=True, force_resume=True, **QUIET)
    assert (out / "config.yaml").read_text() == recipe  # refused before the run's recipe was rewritten


def test_a_fingerprint_reads_inside_a_tensor_of_any_size():
    """28,311,552 elements (SmolLM2's 49,152 x 576 embedding): a float32 linspace put its last pick one past
    the end."""
    from draftsmith.train.infra.checkpoint import fingerprint, same_fingerprint

    embedding = torch.arange(49152 * 576, dtype=torch.bfloat16).view(49152, 576)
    print_ = fingerprint(embedding)
    assert print_["shape"] == [49152, 576] and len(print_["values"]) == 16
    assert print_["values"][-1] == float(embedding[-1, -1])
    assert same_fingerprint(print_, fingerprint(embedding.clone()))
    assert fingerprint(torch.zeros(0))["values"] == []


def safe_open_keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys |= set(f.keys())
    return keys


def test_keep_checkpoints_keeps_the_last_n_step_checkpoints_beside_last(
    tiny_target_dir,
    uniform_conversations,
    tmp_path,  # noqa: F811
):
    out = tmp_path / "run"
    steps = (
        "--trainer.max_steps=5",
        "--trainer.ckpt_every=1",
        "--trainer.val_every=5",
        "--trainer.keep_checkpoints=2",
    )
    train(make_config(tiny_target_dir, uniform_conversations, out, *steps), **QUIET)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["last.ckpt", "step-0000004.ckpt", "step-0000005.ckpt"]
    assert torch.load(out / "checkpoints" / "step-0000004.ckpt", weights_only=True)["global_step"] == 4


def test_a_checkpoint_is_fsynced_before_its_rename_and_its_folder_after(monkeypatch, tmp_path):
    import os

    from draftsmith.train.infra.checkpoint import AtomicCheckpointIO

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd)
    )
    monkeypatch.setattr(
        os, "replace", lambda a, b: events.append(("rename", str(a), str(b))) or replace(a, b)
    )
    path = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    (_, tmp, dst) = next(e for e in events if e[0] == "rename")
    assert dst == str(path)
    assert (
        events.index(("fsync", tmp))
        < events.index(("rename", tmp, dst))
        < events.index(("fsync", str(path.parent)))
    )
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], torch.ones(3))


def test_loggers_are_chosen_in_the_recipe(tiny_target_dir, uniform_conversations, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    train(make_config(tiny_target_dir, uniform_conversations, out, "--trainer.max_steps=2",
                      "--trainer.loggers=csv"), **QUIET)  # fmt: skip
    assert list((out / "logs").rglob("metrics.csv")) and not (out / "tensorboard").exists()


def test_a_logger_that_is_not_installed_is_refused_before_anything_is_written(monkeypatch, tmp_path, capsys):
    import importlib.util

    from draftsmith.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {paths: [builtin:gsm8k_train]}\n")
    out = tmp_path / "run"
    assert main(["train", str(recipe), f"--output.dir={out}", "--trainer.loggers=[csv, wandb]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "pip install wandb" in err and "trainer.loggers" in err
    assert not out.exists()


@pytest.mark.parametrize("name, folder", [("wandb", "wandb"), ("mlflow", "mlruns")])
def test_wandb_and_mlflow_log_offline_where_installed(name, folder, monkeypatch, tiny_target_dir,
                                                      uniform_conversations, tmp_path):  # noqa: F811 # fmt: skip
    pytest.importorskip(name, reason=f"{name} is not installed here (an optional logger, not a dependency)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    train(make_config(tiny_target_dir, uniform_conversations, out, "--trainer.max_steps=2",
                      f"--trainer.loggers=[{name}]"), **QUIET)  # fmt: skip
    assert any((out / folder).rglob("*")), f"{name} wrote nothing under {out / folder}"


def test_resume_with_last_ckpt_gone_continues_from_the_newest_step_checkpoint(
    tiny_target_dir,
    uniform_conversations,
    tmp_path,
    capsys,  # noqa: F811
):
    """last.ckpt lost, step checkpoints kept: --resume continues from the newest, saying so (it used to say
    'no checkpoint ... run without --resume', which a run that exported a draft then refused)."""
    out = tmp_path / "run"
    steps = ("--trainer.ckpt_every=1", "--trainer.val_every=3", "--trainer.keep_checkpoints=2")
    train(make_config(tiny_target_dir, uniform_conversations, out, "--trainer.max_steps=3", *steps), **QUIET)
    (out / "checkpoints" / "last.ckpt").unlink()
    capsys.readouterr()
    config = make_config(tiny_target_dir, uniform_conversations, out, "--trainer.max_steps=4", *steps)
    result = train(config, resume=True, **QUIET)
    said = [line for line in capsys.readouterr().out.splitlines() if "--resume:" in line]
    assert said == [
        f"[draftsmith] --resume: {out / 'checkpoints' / 'last.ckpt'} is gone; resuming from the newest step "
        f"checkpoint, {out / 'checkpoints' / 'step-0000003.ckpt'}"
    ]
    assert result.steps == 4
    assert not (out / ".draftsmith.lock").exists()  # a finished run releases its folder


def test_a_resume_with_fewer_keep_checkpoints_removes_the_older_step_checkpoints(
    tiny_target_dir,
    uniform_conversations,
    tmp_path,
    capsys,  # noqa: F811
):
    out = tmp_path / "run"
    steps = ("--trainer.ckpt_every=1", "--trainer.val_every=5")
    train(make_config(tiny_target_dir, uniform_conversations, out, "--trainer.max_steps=3",
                      "--trainer.keep_checkpoints=3", *steps), **QUIET)  # fmt: skip
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "last.ckpt", "step-0000001.ckpt", "step-0000002.ckpt", "step-0000003.ckpt"
    ]  # fmt: skip
    capsys.readouterr()
    config = make_config(tiny_target_dir, uniform_conversations, out, "--trainer.max_steps=5",
                         "--trainer.keep_checkpoints=1", *steps)  # fmt: skip
    train(config, resume=True, **QUIET)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step-0000005.ckpt"]
    assert (
        "[draftsmith] trainer.keep_checkpoints=1: removed the older step checkpoints step-0000001.ckpt, "
        "step-0000002.ckpt"
    ) in capsys.readouterr().out


def test_a_recipe_refused_after_the_data_stage_leaves_no_new_folder(
    tiny_target_dir,
    uniform_conversations,
    tmp_path,  # noqa: F811
):
    """A tap layer out of range is found once the target is loaded and the data rendered: the new output folder
    the run made (its dataset cache, its lock) goes with the refusal, as a refusal before loading leaves none."""
    out = tmp_path / "new"
    taps = ("--draft.kind=eagle3", "--draft.options.capture_layer_ids=[0, 99]")
    with pytest.raises(ValueError, match="capture_layer_ids \\[0, 99\\]: \\[99\\] outside"):
        train(make_config(tiny_target_dir, uniform_conversations, out, *taps), **QUIET)
    assert not out.exists()
