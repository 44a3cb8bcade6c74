"""One training run in its own process, for the tests that need several (DDP, kill-and-resume).

    python tests/train_worker.py TARGET_DIR DATA OUT [--resume] [--kill-at-step N]
        [--pause-at-step N MARKER RELEASE] [--pause-before NAME[:CALL] MARKER RELEASE]
        [--fill-disk-at-step N FILLER] [--no-target-layers] [--section.key=value ...]

Runs ``train`` with the tests' tiny config (``test_loop.make_config``) under deterministic settings
on one thread. ``--kill-at-step N`` SIGKILLs the process right after optimizer step N, as a crash
would: no exception, no cleanup. Lightning's DDP launcher starts the other ranks with this same
command line. ``--pause-before load_target`` (or ``build_feature_cache:2``, its second call) waits, as
``--pause-at-step`` does, before the loop calls that function: a run stopped outside its training steps.
Also registers ``test-noisy``: the linear head behind dropout with a loss scaled by
python and numpy random draws, so a resume that loses any RNG stream shows in the weights.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import lightning as L
import numpy as np
import torch
from test_loop import LinearHead, NoOptions, make_config
from torch import nn

from draftsmith.train.loop import train
from draftsmith.train.registry import register_objective


class NoisyHead(LinearHead):
    kind = "test-noisy"

    def build_draft(self) -> nn.Module:
        return nn.Sequential(nn.Dropout(0.3), nn.Linear(self.hidden, self.vocab))

    def loss(self, draft, batch, teacher):
        out = super().loss(draft, batch, teacher)
        if draft.training:  # python and numpy streams too, not only torch's
            out["loss"] = out["loss"] * (1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand()))
        return out


register_objective("test-noisy", options=NoOptions)(
    lambda target, options, counts: NoisyHead(target, token_counts=counts, **options)
)


class PauseAtStep(L.Callback):
    """After optimizer step N: write MARKER, then wait (up to a minute) until RELEASE exists, so a test can
    act on a process it knows is mid-training (send it a signal, start a second job beside it)."""

    def __init__(self, step: int, marker: str, release: str):
        self.step, self.marker, self.release = step, marker, release

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.05)


def pause_before(name_call: str, marker: str, release: str) -> None:
    """Wrap ``draftsmith.train.loop.<name>`` so that its CALL-th call (default 1st) writes MARKER, then waits
    (up to a minute) until RELEASE exists."""
    import draftsmith.train.loop as loop

    name, _, call = name_call.partition(":")
    original, calls = getattr(loop, name), []

    def paused(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(call or 1):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
        return original(*args, **kwargs)

    setattr(loop, name, paused)


class FillDiskAtStep(L.Callback):
    """After optimizer step N, fill the output folder's filesystem (a small tmpfs in the test) to the last byte."""

    def __init__(self, step: int, filler: str):
        self.step, self.filler = step, filler

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not os.path.exists(self.filler):
            with open(self.filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
                try:  # the last partial block
                    while True:
                        f.write(b"\0")
                        f.flush()
                except OSError:
                    pass


class KillAtStep(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class TargetLayersOnMeta(L.Callback):
    """Fails the run unless the target's decoder layers are on the meta device when training starts."""

    def on_train_start(self, trainer, module) -> None:
        layers = list(module.target.model.get_decoder().layers.parameters())
        if not layers or not all(p.is_meta for p in layers):
            raise RuntimeError(f"rank {trainer.global_rank}: the target's layers were materialised")
        print(f"rank {trainer.global_rank}: target layers on meta", flush=True)


def deterministic() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def main(argv: list[str]) -> None:
    target_dir, data, out, *rest = argv
    resume = "--resume" in rest
    callbacks = []
    if "--kill-at-step" in rest:
        i = rest.index("--kill-at-step")
        callbacks.append(KillAtStep(int(rest[i + 1])))
        del rest[i : i + 2]
    if "--pause-at-step" in rest:
        i = rest.index("--pause-at-step")
        callbacks.append(PauseAtStep(int(rest[i + 1]), rest[i + 2], rest[i + 3]))
        del rest[i : i + 4]
    if "--pause-before" in rest:
        i = rest.index("--pause-before")
        pause_before(*rest[i + 1 : i + 4])
        del rest[i : i + 4]
    if "--fill-disk-at-step" in rest:
        i = rest.index("--fill-disk-at-step")
        callbacks.append(FillDiskAtStep(int(rest[i + 1]), rest[i + 2]))
        del rest[i : i + 3]
    if "--no-target-layers" in rest:  # every rank: loading the whole target is an error, its layers stay meta
        rest.remove("--no-target-layers")
        import draftsmith.train.loop as loop

        def refuse(*args, **kwargs):
            raise RuntimeError("the whole target was loaded")

        loop.load_target = refuse
        callbacks.append(TargetLayersOnMeta())
    overrides = [a for a in rest if a != "--resume"]
    deterministic()
    train(make_config(target_dir, data, out, *overrides), resume=resume, callbacks=callbacks,
          enable_progress_bar=False)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
