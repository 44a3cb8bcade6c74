"""Atomic writes for everything a run leaves behind: Lightning checkpoints, the exported draft, configs.

Every file or directory is written under a temporary name in the same directory and renamed into
place, so a crash or a full disk never leaves a half-written checkpoint where ``--resume`` or
``draftsmith eval --draft`` would pick it up.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from draftsmith import files

CHECKPOINT_DIR = "checkpoints"
LAST = "last.ckpt"
DRAFT_DIR = "draft"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes to ``.<name>.tmp-*`` and renames into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        files.write_with(path, lambda tmp: torch.save(checkpoint, tmp))


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The run's resumable checkpoint (a file, or a directory for DeepSpeed), or None.

    Only whole checkpoints carry the final name (they are renamed into place), so temporary files and
    directories of a write that was cut short are never returned.
    """
    path = Path(output_dir) / CHECKPOINT_DIR / LAST
    if path.is_dir():
        return path if any(path.iterdir()) else None
    return path if path.is_file() and path.stat().st_size > 0 else None


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
