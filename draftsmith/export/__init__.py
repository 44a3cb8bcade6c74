"""Drafts in the layouts serving engines load, one writer per engine record (``drafts/engines.py``).

``export_checkpoint`` asks the draft's kind record and the engine's record whether the engine takes
it (``engines.refusal``), then runs the engine's writer for the kind's family (``engines.writer_of``),
registered by ``draftsmith/export/<engine>.py``: ``hf``, ``vllm``, ``sglang``, ``speculators`` (EAGLE-3 heads
through the reference layout in ``eagle.py``), ``gguf``. Every export is checked afterwards by the engine's verifier
(``verify.py``, ``gguf_verify.py``) against what that engine's loader reads; a real llama.cpp judges
the GGUF files (tests/test_llamacpp.py). Loader versions and conventions: docs/EXPORT.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint, locate_checkpoint
from draftsmith.drafts.base import NONFINITE_FIX
from draftsmith.drafts.engines import Engine
from draftsmith.export.engines import ExportOptions, engine_of, is_single_file, refuse, writer_of
from draftsmith.export.verify import ExportVerificationError, verify_export

TRAINING_FILES = {"train_state.json", "train_config.yaml"}
"""Files in a draft directory that describe the run, not the model: not part of an engine export."""

__all__ = [
    "ExportOptions",
    "ExportVerificationError",
    "check_gguf_replaceable",
    "check_out",
    "export_checkpoint",
    "import_peer_head",
    "verify_export",
]


def copy_draft(ckpt: DraftCheckpoint, out: Path) -> None:
    """The draft's own directory as it is (weights, config, tokenizer if it has one), minus run records."""
    for file in sorted(ckpt.draft_dir.iterdir()):
        if file.is_file() and file.name not in TRAINING_FILES and not file.name.startswith("."):
            shutil.copyfile(file, out / file.name)


def copy_export(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """The writer of a layout that is the draft's transformers directory itself (``hf``; a causal LM for
    vLLM and SGLang)."""
    return files.replace_dir(out, lambda tmp: copy_draft(ckpt, tmp), keep_others=True)


def import_peer_head(ckpt: DraftCheckpoint, target_spec: str | None, workdir: Path) -> DraftCheckpoint:
    """A head or draft another pipeline wrote (a kind with ``read_for``: ``drafts/eagle_import.py``,
    ``drafts/dflash_import.py``), read for the target ``target_spec`` and saved in draftsmith's layout under
    ``workdir``, where every export of it starts from."""
    if not target_spec:
        raise ValueError(
            f"{ckpt.draft_dir} is a {ckpt.kind.title}, which names no target draftsmith can "
            "check it against: pass --target with the model it drafts for (an id or a directory)"
        )
    from draftsmith.decode.target import load_target

    head = ckpt.kind.read_for(load_target(target_spec, device="cpu"), ckpt.draft_dir)
    out = workdir / ckpt.draft_dir.resolve().name
    head.save_pretrained(out)
    return locate_checkpoint(str(out))


def holds_an_export(folder: Path, engine: Engine) -> bool:
    """True for a folder an export wrote: one that lists what draftsmith wrote there (``files.OWNED``), or, for
    an engine whose export is one file (GGUF), a folder of such files only, beside which it writes another."""
    if (folder / files.OWNED).is_file():
        return True
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    return engine.file_suffix is not None and all(
        p.is_file() and p.suffix == engine.file_suffix for p in entries
    )


GGUF_WRITER_KEY = "draftsmith.writer"
"""GGUF metadata key every GGUF draftsmith exports carries (its version): what ``--overwrite`` may replace."""


def gguf_written_by_draftsmith(path: Path) -> bool:
    """True for a GGUF file draftsmith's exporter wrote (it carries ``GGUF_WRITER_KEY``)."""
    from draftsmith.loading import read_gguf

    try:
        return GGUF_WRITER_KEY in read_gguf(path).fields
    except (OSError, ValueError):
        return False


def check_gguf_replaceable(path: Path) -> None:
    """Refuse to replace an existing GGUF file draftsmith did not write, naming it."""
    if path.exists() and not gguf_written_by_draftsmith(path):
        raise ValueError(
            f"{path} is not a GGUF draftsmith wrote (it carries no {GGUF_WRITER_KEY} key). --overwrite replaces "
            "only a GGUF draftsmith exported, never your own file: pass a new path"
        )


def check_out(ckpt: DraftCheckpoint, engine: str | Engine, out: Path, overwrite: bool = False) -> None:
    """Refuse an ``out`` whose writing would replace what the user did not ask to replace: an existing
    single-file export (``.gguf``) or a non-empty folder without ``overwrite``; with it, anything but an
    earlier export, which lists what draftsmith wrote there (``holds_an_export``; the new export replaces
    those files, keeping the user's others there), so a model folder of the user's is never one; and never the
    checkpoint itself, a folder around it, or a file where a folder goes. A place that cannot be written is
    refused here too, before any work."""
    record = engine_of(engine)
    resolved = out.resolve()
    source = ckpt.draft_dir.resolve()
    if resolved == source or resolved in source.parents:
        raise ValueError(f"--out {out} would replace the checkpoint it exports; pass a new folder")
    again = "pass a new path, or --overwrite to replace it"
    if is_single_file(record, out):
        if out.is_dir():
            raise ValueError(
                f"--out {out} is a folder, not a {record.file_suffix} file; pass a file path or another folder"
            )
        if out.exists() and not overwrite:
            raise FileExistsError(f"--out {out} exists; {again}")
        check_gguf_replaceable(out)
        files.check_writable(out.parent, "--out's folder")
        return
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"--out {out} is a file, and the {record.name} export is a folder; pass a folder path"
        )
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"--out {out} exists and is not empty; pass a new folder (exports are never merged), or "
                "--overwrite to replace an earlier export there"
            )
        if not holds_an_export(out, record):
            raise ValueError(
                f"--out {out} is not an export draftsmith wrote: it holds {files.listing(out)} and no {files.OWNED} "
                "list of what draftsmith wrote there. --overwrite replaces only such an export, never your own "
                "files: pass a new folder"
            )
    files.check_writable(out, "--out")


def export_checkpoint(
    ckpt: DraftCheckpoint,
    engine: str | Engine,
    out: Path,
    gguf_dtype: str = "f16",
    target_gguf: str | None = None,
) -> Path:
    """Write ``ckpt`` for ``engine`` (its name or record) under ``out``; return the folder (or file) written.

    What an export killed midway left beside ``out`` (hidden ``.NAME.tmp-*`` / ``.NAME.old-*`` copies of a
    whole export) is removed first, as a training run removes its partial checkpoints. ``out`` is replaced
    whole; the command line checks first that replacing it was asked for (``check_out``). A draft with an
    infinite or NaN tensor is refused, naming it, before anything is written.
    """
    record = engine_of(engine)
    files.remove_stale(out.parent, out.name)
    refuse(ckpt.kind, record)  # the kind's record and the engine's say whether it takes the draft
    files.check_finite(ckpt.draft_dir, NONFINITE_FIX)  # no engine is handed a draft of NaN weights
    return writer_of(ckpt.kind, record)(ckpt, out, ExportOptions(gguf_dtype, target_gguf))
