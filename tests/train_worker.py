"""One training run in its own process, for the tests that need several (DDP, kill-and-resume).

    python tests/train_worker.py TARGET_DIR DATA OUT [--resume] [--kill-at-step N] [--section.key=value ...]

Runs ``train`` with the tests' tiny config (``test_loop.make_config``) under deterministic settings
on one thread. ``--kill-at-step N`` SIGKILLs the process right after optimizer step N, as a crash
would: no exception, no cleanup. Lightning's DDP launcher starts the other ranks with this same
command line. Also registers ``test-noisy``: the linear head behind dropout with a loss scaled by
python and numpy random draws, so a resume that loses any RNG stream shows in the weights.
"""

from __future__ import annotations

import os
import random
import signal
import sys

import lightning as L
import numpy as np
import torch
from test_loop import LinearHead, make_config
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


register_objective("test-noisy")(
    lambda target, options, counts: NoisyHead(target, token_counts=counts, **options)
)


class KillAtStep(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


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
    overrides = [a for a in rest if a != "--resume"]
    deterministic()
    train(make_config(target_dir, data, out, *overrides), resume=resume, callbacks=callbacks,
          enable_progress_bar=False)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
