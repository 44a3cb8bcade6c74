"""Drafts in the layouts serving engines load: transformers (``hf``), vLLM, SGLang, speculators, GGUF.

``export_checkpoint`` dispatches on the draft's kind (``drafts/base.py``: which engines it exports to,
and why it refuses the others) and family: EAGLE heads (``eagle.py``, ``speculators.py``, ``gguf.py``),
ordinary causal LMs (the transformers directory, or ``gguf.py``), Medusa (the transformers directory).
Every export is checked afterwards by ``verify.py`` against what that engine's loader reads; a real
llama.cpp judges the GGUF files (tests/test_llamacpp.py). Loader versions and conventions:
docs/EXPORT.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint, locate_checkpoint
from draftsmith.drafts.base import ENGINES
from draftsmith.export.verify import ExportVerificationError, verify_export

TRAINING_FILES = {"train_state.json", "train_config.yaml"}
"""Files in a draft directory that describe the run, not the model: not part of an engine export."""

__all__ = [
    "ENGINES",
    "ExportVerificationError",
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


def target_gguf_of(ckpt: DraftCheckpoint, given: str | None) -> Path | None:
    """The GGUF of the draft's target: --target-gguf, the bundled SmolLM2 GGUF for its drafts, a target
    recorded as a .gguf file, else None."""
    if given:
        if not Path(given).is_file():
            raise FileNotFoundError(f"--target-gguf {given} does not exist")
        return Path(given)
    from draftsmith.loading import SMOLLM2_ALIAS, smollm2_gguf_path

    name = str(ckpt.target.get("name") or "")
    if name == SMOLLM2_ALIAS:
        return smollm2_gguf_path()
    if name.endswith(".gguf") and Path(name).is_file():
        return Path(name)
    return None


def import_peer_head(ckpt: DraftCheckpoint, target_spec: str | None, workdir: Path) -> DraftCheckpoint:
    """An EAGLE-3 head another pipeline wrote (``drafts/eagle_import.py``), read for the target ``target_spec``
    and saved in draftsmith's layout under ``workdir``, where every export of it starts from."""
    if not target_spec:
        raise ValueError(
            f"{ckpt.draft_dir} is an EAGLE-3 head from another pipeline, which names no target draftsmith can "
            "check it against: pass --target with the model it drafts for (an id or a directory)"
        )
    from draftsmith.decode.target import load_target
    from draftsmith.drafts.eagle_import import import_head

    head = import_head(load_target(target_spec, device="cpu"), ckpt.draft_dir)
    out = workdir / ckpt.draft_dir.resolve().name
    head.save_pretrained(out)
    return locate_checkpoint(str(out))


def holds_an_export(folder: Path) -> bool:
    """True for a folder an earlier export wrote: files only, with a config.json or only GGUF files."""
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    if any(p.is_dir() for p in entries):
        return False
    return (folder / "config.json").is_file() or all(p.suffix == ".gguf" for p in entries)


def check_out(ckpt: DraftCheckpoint, engine: str, out: Path, overwrite: bool = False) -> None:
    """Refuse an ``out`` whose writing would replace what the user did not ask to replace: an existing
    ``.gguf`` file or a non-empty folder without ``overwrite``; with it, anything but an earlier export; and
    never the checkpoint itself, a folder around it, or a file where a folder goes."""
    resolved = out.resolve()
    source = ckpt.draft_dir.resolve()
    if resolved == source or resolved in source.parents:
        raise ValueError(f"--out {out} would replace the checkpoint it exports; pass a new folder")
    again = "pass a new path, or --overwrite to replace it"
    if engine == "gguf" and out.suffix == ".gguf":
        if out.is_dir():
            raise ValueError(f"--out {out} is a folder, not a .gguf file; pass a file path or another folder")
        if out.exists() and not overwrite:
            raise FileExistsError(f"--out {out} exists; {again}")
        return
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"--out {out} is a file, and the {engine} export is a folder; pass a folder path"
        )
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"--out {out} exists and is not empty; pass a new folder (exports are never merged), or "
                "--overwrite to replace an earlier export there"
            )
        if not holds_an_export(out):
            raise ValueError(
                f"--out {out} holds more than an export (sub-folders, or files besides GGUF and no config.json); "
                "--overwrite replaces only an earlier export: pass a new folder"
            )


def export_checkpoint(
    ckpt: DraftCheckpoint,
    engine: str,
    out: Path,
    gguf_dtype: str = "f16",
    target_gguf: str | None = None,
) -> Path:
    """Write ``ckpt`` for ``engine`` under ``out``; return the folder (or GGUF file) written.

    What an export killed midway left beside ``out`` (hidden ``.NAME.tmp-*`` / ``.NAME.old-*`` copies of a
    whole export) is removed first, as a training run removes its partial checkpoints. ``out`` is replaced
    whole; the command line checks first that replacing it was asked for (``check_out``).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    name = (ckpt.run_dir or ckpt.draft_dir).resolve().name
    gguf_file = out if out.suffix == ".gguf" else out / f"{name}-{gguf_dtype}.gguf"
    files.remove_stale(out.parent, out.name)
    if gguf_file != out:
        files.remove_stale(gguf_file.parent, gguf_file.name)
    ckpt.kind.refuse_export(engine)  # the kind's record says which engines take it, and why not the others
    family = ckpt.kind.family
    if engine == "hf":  # draftsmith's own transformers layout, for every kind
        return files.replace_dir(out, lambda tmp: copy_draft(ckpt, tmp))
    if family == "eagle" and engine == "gguf":
        from draftsmith.export.eagle import check_exportable, read_weights
        from draftsmith.export.gguf import write_eagle3_gguf

        check_exportable(ckpt.config, engine)
        source = target_gguf_of(ckpt, target_gguf)
        if source is None:
            raise ValueError(
                f"the head's target {ckpt.target.get('name')!r} has no GGUF that draftsmith knows; llama.cpp "
                "serves an EAGLE-3 head only beside a GGUF of its target. Convert the target with llama.cpp's "
                "convert_hf_to_gguf.py and pass it with --target-gguf FILE."
            )
        return write_eagle3_gguf(
            ckpt.config, read_weights(ckpt.draft_dir), gguf_file, source, gguf_dtype, name
        )
    if family == "eagle":
        from draftsmith.export.eagle import export_eagle

        return export_eagle(ckpt, out, engine)
    if engine == "gguf":
        from draftsmith.export.gguf import write_gguf

        return write_gguf(ckpt.draft_dir, gguf_file, gguf_dtype, target_gguf_of(ckpt, target_gguf))
    return files.replace_dir(out, lambda tmp: copy_draft(ckpt, tmp))  # vLLM / SGLang read the HF directory
