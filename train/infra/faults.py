"""What a cluster throws at a training job: preemption signals, a second job in the same folder, a full disk.

- ``Preemption``: SIGTERM (how SLURM, Kubernetes and spot instances stop a job), SIGUSR1 (what SLURM's
  ``--signal`` sends ahead of a time limit) and SIGINT (Ctrl-C) let the current optimizer step finish,
  save a checkpoint there (the same ``last.ckpt`` exact resume reads), print one line with the resume
  command, and exit with 128 + the signal number: a scheduler never reads a stopped job as done. A
  second SIGINT stops at once.
- ``OutputLock``: an exclusive ``flock`` on ``<output.dir>/.draftsmith.lock``, held for the run by its
  global rank 0. The kernel drops it when the process ends, however it ends, so a kill -9 leaves no stale
  lock; a second job is refused with the holder's pid, host and start time.
- ``stop_on_signals``: outside the training steps (loading the target and data, the offline capture,
  setting up), the same signals stop the run at once; every write is atomic, so nothing half-written stays.
- ``next_step``: what a stopped run kept and the command that goes on from it: ``--resume`` once a
  checkpoint exists, a plain rerun before (which reuses the finished shards of an offline cache).
- ``disk_full_error``: a failed write on a full disk, said as such, with what was kept.
- ``FiniteGuard``: a loss, gradient or weight that turns infinite or NaN stops the run at that optimizer step,
  before anything of it is checkpointed or exported (``NonFiniteError``, said with ``nonfinite_line``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import lightning as L
import torch

from draftsmith.files import DiskFullError, out_of_space
from draftsmith.train.infra.checkpoint import DRAFT_DIR, resume_point

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
LOCK_NAME = ".draftsmith.lock"


class FolderInUseError(ValueError):
    """Another job holds the output folder's lock."""


class Preempted(SystemExit):
    """Training stopped by a signal after saving a checkpoint; the exit code is 128 + the signal."""


class Stopped(Preempted):
    """A signal outside the training steps: the run stops where it is (exit code 128 + the signal)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals():
    """While the block runs, SIGTERM, SIGUSR1 and SIGINT raise ``Stopped`` at once (``Preemption`` takes
    over for the training steps, where stopping waits for the step to finish). Only the main thread can
    set handlers; elsewhere the block runs with the handlers there are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outside = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def stop(signum: int, frame) -> None:
        raise Stopped(signum)

    for sig in SIGNALS:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in outside.items():
            signal.signal(sig, handler)


def next_step(
    output_dir: Path, resume_command: str, rerun_command: str | None, cache_dir: Path
) -> tuple[str, str]:
    """(what a stopped run kept, how to go on): ``resume_command`` once a checkpoint exists; before the first
    one, ``rerun_command`` (``--overwrite`` added when the run already exported a draft, which a plain
    rerun would refuse to replace), reusing the offline cache's finished shards in ``cache_dir``."""
    ckpt = resume_point(output_dir)
    if ckpt is not None:
        return f"the last good checkpoint, {ckpt}, is kept", f"continue with: {resume_command}"
    shards = sorted(cache_dir.glob("*/shard-*.safetensors"))
    kept = "no checkpoint had been saved yet, so a rerun starts over" + (
        f" (reusing the {len(shards)} finished feature-cache shards in {cache_dir})" if shards else ""
    )
    if rerun_command is None:
        recipe = output_dir / "config.yaml"
        if not recipe.is_file():
            return kept, "start again with the same command, without --resume"
        rerun_command = f"draftsmith train {shlex.quote(str(recipe))}"
    draft = output_dir / DRAFT_DIR
    if draft.is_dir() and any(draft.iterdir()) and "--overwrite" not in shlex.split(rerun_command):
        rerun_command += " --overwrite"
    return kept, f"start again with: {rerun_command}"


def stopped_line(signum: int, kept: str, go_on: str) -> str:
    """The one line a run stopped outside its training steps prints."""
    return f"[draftsmith] {signal.Signals(signum).name}: stopped; {kept}; {go_on}"


class Preemption(L.Callback):
    """Stop at the next optimizer-step boundary after SIGTERM, SIGUSR1 or SIGINT, with a checkpoint there.

    ``save(trainer) -> Path`` writes the checkpoint (the loop's own ``last.ckpt``); ``resume_command`` is
    printed with it. Every rank installs the handlers; ranks agree to stop when any of them was signalled,
    so a signal that reaches one rank stops all of them at the same step.
    """

    def __init__(self, save, resume_command: str):
        self.save = save
        self.resume_command = resume_command
        self.received: int | None = None
        self._outside = {sig: signal.getsignal(sig) for sig in SIGNALS}  # before Lightning adds its own
        self._launcher = None
        self._step_at_start = -1

    def _install(self, trainer: L.Trainer) -> None:
        # after Lightning registers its own (which, for SIGTERM, stops but exits 0), in their place
        self._launcher = trainer.strategy.launcher
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def on_sanity_check_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._install(trainer)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._install(trainer)

    def restore(self) -> None:
        """Put back the handlers there were before training (call when fit returns or fails)."""
        for sig, handler in self._outside.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = signum
        launcher = self._launcher  # ranks that Lightning started itself get the signal from here
        if launcher is not None and getattr(launcher, "procs", None):
            launcher.kill(signum)

    def on_train_batch_start(self, trainer: L.Trainer, module, batch, batch_idx: int) -> None:
        self._step_at_start = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._step_at_start:  # mid-accumulation: not a step boundary
            return
        stop = trainer.strategy.reduce_boolean_decision(self.received is not None, all=False)
        if not stop:
            return
        path = self.save(trainer)
        name = signal.Signals(self.received).name if self.received else "a signal on another rank"
        if trainer.is_global_zero:
            print(
                f"\n[draftsmith] {name}: stopped after step {trainer.global_step}, saved {path}; "
                f"continue with: {self.resume_command}",
                flush=True,
            )
        raise Preempted(128 + (self.received or signal.SIGTERM))

    def after_run(self) -> None:
        """A signal that came after the last step (final validation, export): the run is whole, and says so."""
        if self.received is not None:
            name = signal.Signals(self.received).name
            print(f"[draftsmith] {name} came after the last step; the run finished and is saved", flush=True)
            raise Preempted(128 + self.received)


class OutputLock:
    """An exclusive lock on an output folder for as long as a job runs there (a context manager).

    ``flock`` locks are the kernel's: they die with the process, so there is never a stale lock to clear.
    On network filesystems they hold across machines where the filesystem supports them (NFSv4; NFSv3
    with lockd; Lustre mounted with ``-o flock``). Where it refuses locks (ENOLCK, EOPNOTSUPP), the job
    warns and runs without one. The lock file is removed when the job ends, while it is still locked; a job
    that locked a file just removed so (its path now names another file or none) takes the lock again.

    A run that made the folder and is refused by a config check (a ``ValueError`` other than a non-finite
    stop) before it saved any checkpoint or draft leaves nothing: the folder goes with what the run put in it
    (its dataset cache, token counts, recipe, logs).
    """

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK_NAME
        self._file = None
        self._made_folder = False

    def __enter__(self) -> OutputLock:
        self._made_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            f = self._lock()
            try:  # locked the file an ending job removed: the path is someone else's (or no one's) now
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            f.close()
        f.seek(0)
        f.truncate()
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        f.write(json.dumps(holder) + "\n")
        f.flush()
        os.chmod(self.path, 0o644)
        self._file = f
        return self

    def _lock(self):
        f = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the lock's life)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe_holder(f.read())
            f.close()
            raise FolderInUseError(
                f"{self.path.parent} is in use by another training job ({holder}); two jobs in one output "
                "folder overwrite each other's checkpoints. Wait for it, stop it, or set --output.dir to "
                "another folder"
            ) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                f.close()
                raise
            print(
                f"[draftsmith] warning: {self.path.parent}'s filesystem does not support file locks "
                f"({err.strerror}); nothing stops a second job from using this output folder",
                flush=True,
            )
        return f

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._file is None:
            return
        folder = self.path.parent
        refused = (
            exc_type is not None
            and issubclass(exc_type, ValueError)
            and not issubclass(exc_type, NonFiniteError)
        )
        if (
            self._made_folder
            and refused
            and resume_point(folder) is None
            and not (folder / DRAFT_DIR).exists()
        ):
            shutil.rmtree(folder, ignore_errors=True)  # a new folder, refused before it held any work
        else:
            self.path.unlink(missing_ok=True)  # while still locked: see the class doc
            if self._made_folder and not os.listdir(folder):  # a run that failed before writing
                folder.rmdir()
        self._file.close()  # closing releases the lock
        self._file = None


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"


def disk_full_error(err: BaseException, folder: Path, kept: str, go_on: str) -> DiskFullError | None:
    """A whole-sentence error for a write into ``folder`` that failed for want of space, else None
    (``kept``, ``go_on``: what was kept and how to go on, from ``next_step``).

    torch's zip writer reports a full disk as ``RuntimeError: ... unexpected pos``, without the errno,
    so the free space of the folder is asked too.
    """
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    torch_writer = any("unexpected pos" in str(e) or "PytorchStreamWriter" in str(e) for e in _chain(err))
    if not (out_of_space(err) or (torch_writer and free < 64 * 2**20)):
        return None
    return DiskFullError(
        f"No space left on device while writing into {folder} ({free / 2**20:.0f} MiB free); {kept}. Free some "
        f"space and {go_on}"
    )


def _chain(err: BaseException):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


class NonFiniteError(ValueError):
    """Training met a loss, gradient or weight that is not finite (``what`` says which) at optimizer step
    ``step``; nothing of that step was saved."""

    def __init__(self, what: str, step: int):
        super().__init__(f"{what} at optimizer step {step}")
        self.what, self.step = what, step


def nonfinite_line(err: NonFiniteError, kept: str, go_on: str, lr: float) -> str:
    """The one line a run stopped by a non-finite value ends with (``kept``, ``go_on``: from ``next_step``;
    a resume with a changed recipe needs ``--force-resume``)."""
    force = " --force-resume" if go_on.startswith("continue") else ""
    return (
        f"training stopped: {err.what} at optimizer step {err.step}, and nothing of that step was saved; {kept}. "
        f"With a lower optim.lr (now {lr:g}) or more optim.warmup_steps, {go_on}{force}"
    )


def _first_bad(tensors: list[torch.Tensor]) -> int | None:
    """The index of the first tensor with an infinite or NaN entry, or None; one device sync for all. A
    sharded tensor (FSDP2's DTensor) is checked on this rank's shard: the ranks' verdicts are combined after."""
    if not tensors:
        return None
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    finite = torch.stack([torch.isfinite(t).all() for t in local]).cpu()
    return None if bool(finite.all()) else int((~finite).nonzero()[0])


class FiniteGuard(L.Callback):
    """Stop at the first optimizer step whose loss, gradient or updated weights are not finite.

    The micro-batches' losses and the gradients are checked before the optimizer steps, the trainable
    weights after it, before the checkpoint and the validation's export of that step (Lightning runs
    checkpoint callbacks last). Ranks agree, so all of them stop at the same step. Under a gradient scaler
    (16-mixed) an infinite gradient is the scaler's to skip, so only the loss and the weights are checked.
    """

    def __init__(self):
        self._losses: list[torch.Tensor] = []
        self._step_at_start = -1

    def on_train_batch_start(self, trainer: L.Trainer, module, batch, batch_idx: int) -> None:
        self._step_at_start = trainer.global_step

    def on_before_backward(self, trainer: L.Trainer, module, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def _stop_if(self, trainer: L.Trainer, what: str | None, step: int) -> None:
        if trainer.strategy.reduce_boolean_decision(what is not None, all=False):
            raise NonFiniteError(what or "a value on another rank turned non-finite", step)

    def on_before_optimizer_step(self, trainer: L.Trainer, module, optimizer) -> None:
        losses, self._losses = self._losses, []
        grads: list[tuple[str, torch.Tensor]] = []
        if getattr(trainer.precision_plugin, "scaler", None) is None:
            names = {id(p): name for name, p in module.named_parameters()}
            grads = [(names.get(id(p), "a parameter"), p.grad) for group in optimizer.param_groups
                     for p in group["params"] if p.grad is not None]  # fmt: skip
        i = _first_bad(losses + [g for _, g in grads])
        what = None
        if i is not None:
            turned = f"turned {float(losses[i]):g}" if i < len(losses) else None
            what = (
                f"the training loss {turned}"
                if turned
                else f"the gradient of {grads[i - len(losses)][0]} turned non-finite"
            )
        self._stop_if(trainer, what, trainer.global_step + 1)

    def on_train_batch_end(self, trainer: L.Trainer, module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._step_at_start:  # mid-accumulation: the weights did not move
            return
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        i = _first_bad([p for _, p in named])
        what = None if i is None else f"weight {named[i][0]} turned non-finite"
        self._stop_if(trainer, what, trainer.global_step)
