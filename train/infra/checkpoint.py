"""Atomic writes for everything a run leaves behind: Lightning checkpoints, the exported draft, configs.

Every file or directory is written under a temporary name in the same directory and renamed into
place, so a crash or a full disk never leaves a half-written checkpoint where ``--resume`` or
``draftsmith eval --draft`` would pick it up. A checkpoint is fsynced before its rename and its folder
after it, so a power cut or a node lost after the rename cannot leave an empty or torn ``last.ckpt``.

Checkpoints leave out the draft's frozen copies of the target's weights (an 8B target's embedding is
~2 GB in float32): the draft rebuilt from the target on resume has them again, and a fingerprint of each
(``frozen_fingerprints``) refuses a resume against another target.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from draftsmith import files

CHECKPOINT_DIR = "checkpoints"
LAST = "last.ckpt"
DRAFT_DIR = "draft"
TRAIN_STATE = "train_state.json"
"""In ``draft/``: the run's last validation, written with every export of the draft (what marks it trained)."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes to ``.<name>.tmp-*`` and renames into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        write_durably(path, lambda tmp: torch.save(checkpoint, tmp))


def write_durably(path: str | Path, write) -> Path:
    """``files.write_with`` with the data on disk before the rename (the file fsynced) and the rename on
    disk before returning (the folder fsynced)."""

    def write_synced(tmp: Path) -> None:
        write(tmp)
        files.fsync_path(tmp)

    path = files.write_with(path, write_synced)
    files.fsync_path(path.parent)
    return path


FROZEN = "draftsmith_frozen"
"""Checkpoint key: the target the run trained for and a fingerprint of each frozen weight left out."""


def fingerprint(tensor: torch.Tensor) -> dict:
    """Shape, sum and 16 values spread over ``tensor``: enough to tell one target's weights from another's
    without hashing gigabytes."""
    flat = tensor.detach().flatten()
    # integer positions: a float linspace rounds n - 1 up to n past 2**24 elements (a 49,152 x 576 embedding)
    picks = (torch.arange(16, dtype=torch.int64) * max(flat.numel() - 1, 0) // 15).to(flat.device)
    return {
        "shape": list(tensor.shape),
        "sum": float(flat.double().sum()),
        "values": flat[picks].double().cpu().tolist() if flat.numel() else [],
    }


def same_fingerprint(a: dict, b: dict) -> bool:
    if a["shape"] != b["shape"]:
        return False
    close = torch.allclose(torch.tensor(a["values"]), torch.tensor(b["values"]), rtol=1e-2, atol=1e-3)
    return close and abs(a["sum"] - b["sum"]) <= 1e-2 * max(abs(a["sum"]), abs(b["sum"])) + 1e-3


def drop_frozen(checkpoint: dict[str, Any], frozen: dict[str, torch.Tensor], target: str) -> None:
    """Take the frozen target weights (``{state-dict key: tensor}``) out of ``checkpoint["state_dict"]``,
    keeping their fingerprints and the target's name."""
    state = checkpoint.get("state_dict") or {}
    left_out = {key: fingerprint(tensor) for key, tensor in frozen.items() if key in state}
    for key in left_out:
        del state[key]
    checkpoint[FROZEN] = {"target": target, "tensors": left_out}


def check_frozen(saved: dict | None, frozen: dict[str, torch.Tensor], target: str, path) -> None:
    """Refuse a resume whose frozen target weights are not the ones the checkpoint (its ``FROZEN`` record,
    ``saved``) was trained with."""
    for key, want in (saved or {}).get("tensors", {}).items():
        have = frozen.get(key)
        if have is None or not same_fingerprint(want, fingerprint(have)):
            raise ValueError(
                f"checkpoint {path} was trained for target {saved['target']!r}, and the frozen weight {key} "
                f"of this run's target {target!r} is not the one it was trained with: resume with the same "
                f"target (--target.spec={saved['target']}), or start the run anew in another --output.dir"
            )


def check_resume_target(path: Path, frozen: dict[str, torch.Tensor], target: str) -> None:
    """``check_frozen`` against the checkpoint file at ``path`` before a resume writes anything (memory-mapped:
    only its small ``FROZEN`` record is read). A DeepSpeed checkpoint folder is checked when it loads."""
    if not Path(path).is_file():
        return
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    check_frozen(checkpoint.get(FROZEN), frozen, target, path)


def restore_frozen(checkpoint: dict[str, Any], frozen: dict[str, torch.Tensor], target: str, path) -> None:
    """Put this run's frozen target weights back into a checkpoint ``drop_frozen`` wrote (one that still
    holds them is left as it is), after checking they are the weights it was trained with."""
    saved = checkpoint.get(FROZEN)
    if saved is None or not saved["tensors"]:
        return
    check_frozen(saved, frozen, target, path)
    state = checkpoint.setdefault("state_dict", {})
    for key in saved["tensors"]:
        state[key] = frozen[key]


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The run's resumable checkpoint (a file, or a directory for DeepSpeed), or None.

    Only whole checkpoints carry the final name (they are renamed into place), so temporary files and
    directories of a write that was cut short are never returned.
    """
    path = Path(output_dir) / CHECKPOINT_DIR / LAST
    if path.is_dir():
        return path if any(path.iterdir()) else None
    return path if path.is_file() and path.stat().st_size > 0 else None


def step_checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's whole step checkpoints (``step-NNNNNNN.ckpt``, kept by ``trainer.keep_checkpoints``), oldest
    first."""
    directory = Path(output_dir) / CHECKPOINT_DIR
    found = sorted(directory.glob("step-*.ckpt")) if directory.is_dir() else []
    return [p for p in found if (any(p.iterdir()) if p.is_dir() else p.stat().st_size > 0)]


class StepCheckpoints(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (``last.ckpt`` and the newest ``save_top_k`` step checkpoints) held to
    ``save_top_k`` also when a resume lowers it: Lightning restores the longer list and then drops one a save
    only while the list is exactly that long, so the older ones stayed for good. When training starts, the
    step checkpoints beyond the newest ``save_top_k`` are removed (said in a line), never the one resumed from."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        if self.dirpath is None or self.save_top_k < 0:
            return
        steps = step_checkpoints(Path(self.dirpath).parent)
        resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path else None
        extra = [p for p in steps[: max(len(steps) - self.save_top_k, 0)] if p.resolve() != resumed]
        for path in extra:
            self.best_k_models.pop(str(path), None)
            self.best_k_models.pop(str(path.resolve()), None)
        if self.best_k_models:  # the worst kept is the next to go (mode "max" on the step)
            self.kth_best_model_path = min(self.best_k_models, key=lambda k: float(self.best_k_models[k]))
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        if extra and trainer.is_global_zero:
            for path in extra:
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            print(
                f"[draftsmith] trainer.keep_checkpoints={self.save_top_k}: removed the older step checkpoints "
                f"{', '.join(p.name for p in extra)}",
                flush=True,
            )


def resume_point(output_dir: str | Path) -> Path | None:
    """Where ``--resume`` continues from: ``last.ckpt``, or, where it is gone, the newest step checkpoint."""
    steps = step_checkpoints(output_dir)
    return last_checkpoint(output_dir) or (steps[-1] if steps else None)


def remove_partial_checkpoints(output_dir: str | Path) -> list[Path]:
    """Delete what checkpoint writes killed midway left behind (``.<name>.tmp*``); return what went."""
    directory = Path(output_dir) / CHECKPOINT_DIR
    removed = sorted(directory.glob(".*.tmp*")) if directory.is_dir() else []
    for path in removed:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return removed


def export_draft(
    objective, draft: torch.nn.Module, directory: str | Path, extra_files: dict[str, str]
) -> Path:
    """Save the draft as ``objective.save`` writes it (save_pretrained) plus text files, atomically."""

    def fill(tmp: Path) -> None:
        objective.save(draft, tmp)
        for name, text in extra_files.items():
            (tmp / name).write_text(text)

    return files.replace_dir(directory, fill)
