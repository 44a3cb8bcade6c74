"""Faults a cluster throws at a real training subprocess: preemption signals, a second job in the same
folder, a full disk. Each run is compared with a straight run, bit for bit, after it resumes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic.dataclasses import dataclass as pydantic_dataclass
from safetensors.torch import load_file
from test_loop import LinearHead, conversations, tiny_target_dir  # noqa: F401 (fixtures)
from test_resume import RUN, WORKER, final_weights, run_worker, uniform_conversations  # noqa: F401

from draftsmith import files
from draftsmith.cli import main
from draftsmith.train.infra.checkpoint import last_checkpoint
from draftsmith.train.infra.faults import LOCK_NAME, FolderInUseError, OutputLock
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION


def start_paused(folder: Path, step: int | str, *args) -> tuple[subprocess.Popen, Path]:
    """A worker (``*args``: its arguments) that has finished optimizer step ``step`` (or, given a name such
    as ``load_target`` or ``build_feature_cache:2``, is about to make that call of the loop) and waits there
    until the returned release file exists."""
    marker, release = folder / "at_step", folder / "release"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    pause = ["--pause-before", step] if isinstance(step, str) else ["--pause-at-step", str(step)]
    cmd = [sys.executable, str(WORKER), *map(str, args), *pause, str(marker), str(release)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 600
    while not marker.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(
                f"the worker ended before step {step}: rc {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
            )
        assert time.monotonic() < deadline, f"the worker did not reach step {step}"
        time.sleep(0.05)
    return proc, release


@pytest.fixture(scope="module")
def straight(tiny_target_dir, uniform_conversations, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = run_worker(tiny_target_dir, uniform_conversations, out, *RUN, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_weights(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.slow
def test_a_signal_saves_at_the_next_step_says_how_to_resume_and_never_exits_0(
    sig,
    tiny_target_dir,
    uniform_conversations,
    straight,
    tmp_path,  # noqa: F811
):
    out = tmp_path / "run"
    proc, release = start_paused(tmp_path, 2, tiny_target_dir, uniform_conversations, out, *RUN)
    proc.send_signal(sig)  # mid-training, before the first checkpoint (ckpt_every=3)
    release.touch()
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 128 + sig, f"rc {proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    lines = [line for line in stdout.splitlines() if line.startswith(f"[draftsmith] {sig.name}:")]
    assert len(lines) == 1, stdout[-3000:]
    saved = re.search(r"stopped after step (\d+), saved (\S+); continue with: (.+)$", lines[0])
    assert saved and Path(saved[2]) == last_checkpoint(out), lines[0]
    assert saved[3] == f"draftsmith train {out / 'config.yaml'} --resume"
    # the step under way when the signal came finishes (step 3 here: the worker paused after step 2)
    assert torch.load(saved[2], weights_only=True)["global_step"] == int(saved[1]) in (2, 3)
    resumed = run_worker(tiny_target_dir, uniform_conversations, out, *RUN, "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = final_weights(out)
    assert all(torch.equal(after[k], straight[k]) for k in straight), "resume after the signal is not exact"


def stop_line(proc: subprocess.Popen, sig: signal.Signals) -> str:
    """The one line a worker stopped by ``sig`` printed (its exit code checked: 128 + the signal)."""
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 128 + sig, f"rc {proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    lines = [line for line in stdout.splitlines() if line.startswith(f"[draftsmith] {sig.name}:")]
    assert len(lines) == 1, f"{stdout[-2000:]}\n{stderr[-3000:]}"
    return lines[0]


@pytest.mark.slow
def test_a_signal_during_the_offline_capture_says_a_plain_rerun_goes_on_which_reuses_the_shards(
    tiny_target_dir,
    uniform_conversations,
    straight,
    tmp_path,  # noqa: F811
):
    out = tmp_path / "run"
    offline = (*RUN, "--mode=offline")
    proc, release = start_paused(tmp_path, "build_feature_cache:2", tiny_target_dir, uniform_conversations,
                                 out, *offline)  # fmt: skip
    proc.send_signal(signal.SIGTERM)  # the training rows are cached, the held-out ones not yet
    release.touch()
    line = stop_line(proc, signal.SIGTERM)
    shards = sorted((out / "feature_cache" / "train").glob("shard-*.safetensors"))
    assert shards and f"reusing the {len(shards)} finished feature-cache shards" in line, line
    assert line.endswith(f"start again with: draftsmith train {out / 'config.yaml'}"), line
    assert last_checkpoint(out) is None  # so --resume, which the old line led to, has nothing to resume
    written = {path: path.stat().st_mtime_ns for path in shards}
    rerun = run_worker(tiny_target_dir, uniform_conversations, out, *offline, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert {path: path.stat().st_mtime_ns for path in shards} == written  # reused, not computed again


@pytest.mark.slow
def test_a_signal_while_the_target_loads_says_so_in_one_line_and_leaves_nothing(
    tiny_target_dir,
    uniform_conversations,
    tmp_path,  # noqa: F811
):
    out = tmp_path / "run"
    proc, release = start_paused(tmp_path, "load_target", tiny_target_dir, uniform_conversations, out, *RUN)
    proc.send_signal(signal.SIGTERM)
    release.touch()
    line = stop_line(proc, signal.SIGTERM)
    assert (
        "no checkpoint had been saved yet" in line
        and "start again with the same command, without --resume" in line
    )
    assert not out.exists()  # nothing had been written: the folder went with its lock


@pytest.mark.slow
def test_a_second_job_in_the_same_folder_is_refused_naming_the_first(
    tiny_target_dir,
    uniform_conversations,
    straight,
    tmp_path,  # noqa: F811
):
    out = tmp_path / "run"
    first, release = start_paused(tmp_path, 1, tiny_target_dir, uniform_conversations, out, *RUN)
    second = run_worker(
        tiny_target_dir, uniform_conversations, out, *RUN, "--optim.lr=0.5", "--trainer.seed=7", timeout=600
    )
    release.touch()
    first_out, first_err = first.communicate(timeout=600)
    assert second.returncode != 0
    assert f"in use by another training job (pid {first.pid} on " in second.stderr
    assert first.returncode == 0, first_err[-3000:]
    after = final_weights(out)  # the first run's work, whole
    assert all(torch.equal(after[k], straight[k]) for k in straight)


def test_the_lock_dies_with_its_process_and_a_failed_start_leaves_nothing(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from draftsmith.train.infra.faults import OutputLock\n"
         f"with OutputLock({str(folder)!r}):\n    print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(FolderInUseError, match=f"pid {holder.pid} on "):
        OutputLock(folder).__enter__()
    holder.kill()  # kill -9: no cleanup, yet no stale lock
    holder.wait()
    with OutputLock(folder):
        assert (folder / LOCK_NAME).is_file()
    fresh = tmp_path / "never_used"
    with OutputLock(fresh):
        pass
    assert not fresh.exists()  # nothing written there: the folder goes with its lock file


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_says_so_keeps_the_last_checkpoint_and_resumes_once_freed(
    tiny_target_dir,
    uniform_conversations,
    straight,
    small_disk,  # noqa: F811
):
    out, filler = small_disk / "run", small_disk / "filler"
    proc = run_worker(
        tiny_target_dir, uniform_conversations, out, *RUN, "--fill-disk-at-step", "4", filler, timeout=600
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "No space left on device while writing into" in last, proc.stderr[-3000:]
    assert f"the last good checkpoint, {out / 'checkpoints' / 'last.ckpt'}, is kept" in last
    assert torch.load(last_checkpoint(out), weights_only=True)["global_step"] == 3
    filler.unlink()
    resumed = run_worker(tiny_target_dir, uniform_conversations, out, *RUN, "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = final_weights(out)
    assert all(torch.equal(after[k], straight[k]) for k in straight)


@pytest.mark.slow
def test_a_full_disk_before_the_first_checkpoint_gives_the_rerun_that_works(
    tiny_target_dir,
    uniform_conversations,
    straight,
    small_disk,  # noqa: F811
):
    out, filler = small_disk / "run", small_disk / "filler"
    proc = run_worker(
        tiny_target_dir, uniform_conversations, out, *RUN, "--fill-disk-at-step", "1", filler, timeout=600
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "No space left on device while writing into" in last, proc.stderr[-3000:]
    assert "no checkpoint had been saved yet, so a rerun starts over" in last
    assert last.endswith(f"Free some space and start again with: draftsmith train {out / 'config.yaml'}"), (
        last
    )
    assert last_checkpoint(out) is None and not list((out / "checkpoints").glob(".*tmp*"))
    filler.unlink()
    rerun = run_worker(tiny_target_dir, uniform_conversations, out, *RUN, timeout=600)  # the command, run
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = final_weights(out)
    assert all(torch.equal(after[k], straight[k]) for k in straight)


def test_the_command_line_prints_a_full_disk_in_one_line(monkeypatch, tmp_path, capsys):
    def full(*args, **kwargs):
        raise files.DiskFullError("No space left on device while writing into x; resume with y")

    monkeypatch.setattr("draftsmith.train.loop.train", full)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("draft: {kind: eagle3}\ndata: {paths: [builtin:gsm8k_train]}\n")
    assert main(["train", str(recipe)]) == 2
    assert capsys.readouterr().err.strip() == (
        "draftsmith train: error: No space left on device while writing into x; resume with y"
    )


@pytest.mark.slow
def test_a_cut_short_checkpoint_is_named_before_the_target_loads(
    tiny_target_dir,
    uniform_conversations,
    tmp_path,  # noqa: F811
):
    from test_loop import make_config

    from draftsmith.train.loop import train

    out = tmp_path / "run"
    proc = run_worker(tiny_target_dir, uniform_conversations, out, *RUN, "--trainer.max_steps=3", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = last_checkpoint(out)
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])  # a copy cut short
    config = make_config(tiny_target_dir, uniform_conversations, out, *RUN)
    with pytest.raises(ValueError, match=rf"{re.escape(str(ckpt))} is cut short or corrupt.*Copy it again"):
        train(config, resume=True, target="never loaded", enable_progress_bar=False)


class PoisonedHead(LinearHead):
    """test_loop's linear head, whose optimizer step ``at`` turns non-finite: its loss (``what="loss"``), its
    gradient alone, the loss staying finite (``"grad"``: d sqrt(|x|)/dx at 0), or a weight alone, the loss
    and the gradient staying finite (``"weight"``: set to infinity once its gradient is in)."""

    kind = "test-poisoned"

    def __init__(self, target, what: str = "loss", at: int = 3, token_counts=None):
        super().__init__(target, token_counts=token_counts)
        self.what, self.at, self.calls = what, at, 0

    def loss(self, draft, batch, teacher):
        out = super().loss(draft, batch, teacher)
        if not draft.training:
            return out
        self.calls += 1
        if self.calls == self.at and self.what == "loss":
            out["loss"] = out["loss"] * float("nan")
        elif self.calls == self.at and self.what == "grad":
            out["loss"] = out["loss"] + torch.sqrt((draft.weight - draft.weight.detach()).abs().sum())
        elif self.calls == self.at and self.what == "weight":

            def poison(weight: torch.Tensor) -> None:
                weight.data.fill_(float("inf"))
                handle.remove()

            handle = draft.weight.register_post_accumulate_grad_hook(poison)
        return out


@pydantic_dataclass(config=SECTION)
class PoisonedOptions:
    """``draft.options`` of ``test-poisoned``."""

    what: Literal["loss", "grad", "weight"] = "loss"
    """What turns non-finite."""
    at: int = 3
    """At which optimizer step."""


register_objective("test-poisoned", options=PoisonedOptions)(
    lambda target, options, counts: PoisonedHead(target, token_counts=counts, **options)
)


@pytest.mark.parametrize(
    "what, said",
    [
        ("loss", "the training loss turned nan at optimizer step 3"),
        ("grad", "the gradient of draft.weight turned non-finite at optimizer step 3"),
        ("weight", "weight draft.weight turned non-finite at optimizer step 3"),
    ],
)
def test_a_loss_gradient_or_weight_that_turns_non_finite_stops_the_run_and_nothing_non_finite_is_saved(
    what,
    said,
    tiny_target_dir,
    conversations,
    tmp_path,
    capsys,  # noqa: F811
):
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"draft: {{kind: test-poisoned, options: {{what: {what}, at: 3}}}}\n")
    overrides = [
        f"--target.spec={tiny_target_dir}", "--target.device=cpu", f"--data.paths=[{conversations}]",
        "--data.max_length=48", "--data.heldout=4", "--optim.lr=0.1", "--trainer.batch_size=4",
        "--trainer.accelerator=cpu", "--trainer.max_steps=6", "--trainer.ckpt_every=2", "--trainer.val_every=2",
        "--trainer.loggers=csv", f"--output.dir={out}",
    ]  # fmt: skip
    assert main(["train", str(recipe), *overrides]) == 2  # never exit 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    last = out / "checkpoints" / "last.ckpt"
    assert err.startswith(f"draftsmith train: error: training stopped: {said}, and nothing of that step"), err
    assert f"the last good checkpoint, {last}, is kept" in err, err
    again = shlex.join(["draftsmith", "train", str(recipe), *overrides, "--resume"])
    assert err.endswith(f"continue with: {again} --force-resume"), err
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())
    exported = load_file(str(out / "draft" / "model.safetensors"))  # the export of the step-2 validation
    assert all(torch.isfinite(t).all() for t in exported.values())
    assert json.loads((out / "draft" / "train_state.json").read_text())["step"] == 2
