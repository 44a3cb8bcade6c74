"""Atomic writes for everything a run leaves behind: Lightning checkpoints, the exported draft, configs.

Every file or directory is written under a temporary name in the same directory and renamed into
place, so a crash or a full disk never leaves a half-written checkpoint where ``--resume`` or
``draftsmith eval --draft`` would pick it up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

CHECKPOINT_DIR = "checkpoints"
LAST = "last.ckpt"
DRAFT_DIR = "draft"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes to ``.<name>.tmp-<pid>`` and renames into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


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


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def replace_dir_atomic(directory: str | Path, fill: Callable[[Path], None]) -> Path:
    """Build a directory with ``fill(tmp_dir)`` and swap it in for ``directory``.

    The old directory is moved aside, the new one renamed into place, then the old one deleted: a
    reader sees the old whole directory or the new whole directory (or, for an instant, none).
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def export_draft(
    objective, draft: torch.nn.Module, directory: str | Path, extra_files: dict[str, str]
) -> Path:
    """Save the draft as ``objective.save`` writes it (save_pretrained) plus text files, atomically."""

    def fill(tmp: Path) -> None:
        objective.save(draft, tmp)
        for name, text in extra_files.items():
            (tmp / name).write_text(text)

    return replace_dir_atomic(directory, fill)
