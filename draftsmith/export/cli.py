"""``draftsmith export CKPT --to ENGINE``: the command line of ``draftsmith.export``; its ``--to`` choices and
description are generated from the engine records (``drafts/engines.py``) and the kind records."""

from __future__ import annotations

import argparse
import tempfile
import textwrap
from pathlib import Path

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint, locate_checkpoint
from draftsmith.drafts.base import draft_kind, kind_names
from draftsmith.drafts.engines import export_engines
from draftsmith.export import check_out, export_checkpoint, import_peer_head
from draftsmith.export.engines import engine_names, load_kind_exports, refusal

INTRO = """\
Export a draft checkpoint (a `draftsmith train` run directory, its draft/ directory, or a Hub id) in
the layout an engine loads, then verify the result against what that engine's loader reads. EAGLE-3
heads are written with their layer ids ascending and fc's columns permuted to match, as engines
concatenate the captured states in ascending layer order."""
OUTRO = """\
EAGLE-3 heads other pipelines wrote (SpecForge/SGLang, ModelOpt, speculators, SafeAILab/EAGLE) and DFlash drafts
(SpecForge, speculators): give --target; the head is read into draftsmith's layout for it (docs/EXPORT.md,
"Reading heads from other pipelines").
Loader versions and conventions: docs/EXPORT.md."""


def _wrapped(first: str, text: str, indent: int = 20) -> list[str]:
    return textwrap.wrap(text, 110, initial_indent=first.ljust(indent), subsequent_indent=" " * indent)


def description() -> str:
    """The engines (what each writes, what it refuses, the version checked) and where each kind goes."""
    load_kind_exports()  # each kind adds its line to the engines it goes to
    lines = [INTRO, "", "Engines:"]
    for engine in export_engines():
        lines += _wrapped(f"  --to {engine.name}", "; ".join([engine.help, *engine.family_help.values()]))
        lines += _wrapped("", f"checked against {engine.checked}")
        for family, why in engine.refuses.items():
            lines += _wrapped("", f"refuses a {family} draft: {why}")
    lines += ["", "Kinds and the engines that take them:"]
    for kind in map(draft_kind, kind_names()):
        takers = [e.name for e in export_engines() if refusal(kind, e) is None]
        if takers:
            lines += _wrapped(f"  {kind.name}", ", ".join(takers))
        elif kind.read_for is None:  # another pipeline's layout: said below
            lines += _wrapped(f"  {kind.name}", f"none: {kind.refusal}")
    return "\n".join([*lines, "", OUTRO])


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``export`` subcommand; ``args.func`` runs it."""
    p = subparsers.add_parser(
        "export",
        help=f"export a draft in the layout {', '.join(e.title for e in export_engines())} loads",
        description=description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="run directory, draft directory or Hub id (or, with --verify, an export)",
    )
    p.add_argument(
        "--to", required=True, choices=engine_names(), help="the engine whose loader the export targets"
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="output folder (created; for gguf a folder or a .gguf path); default: <run dir>/export-<engine>",
    )
    p.add_argument(
        "--gguf-dtype",
        choices=["f32", "f16", "bf16", "q8_0"],
        default="f16",
        help="GGUF weight type (default f16; norms stay f32; bf16 suits CPUs with bf16 dot products)",
    )
    p.add_argument(
        "--target-gguf",
        "--tokenizer-gguf",
        dest="target_gguf",
        metavar="FILE",
        default=None,
        help="the GGUF of the draft's target (the one llama.cpp will serve with): its tokenizer metadata is copied "
        "after checking the pair (default: the bundled SmolLM2 GGUF for drafts of smollm2-135m-instruct; else a "
        "small draft's tokenizer is written from its own files, and an EAGLE-3 head needs this flag)",
    )
    p.add_argument(
        "--target",
        metavar="MODEL",
        default=None,
        help="the target model (id or directory) of an EAGLE-3 head another pipeline wrote (SpecForge, ModelOpt, "
        "speculators, SafeAILab/EAGLE): the head is read for it and checked against it before export",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export at --out (a folder holding one, or a .gguf file draftsmith wrote): the "
        "files draftsmith wrote there are replaced, your other files in it kept; never anything else",
    )
    p.add_argument(
        "--verify", action="store_true", help="only verify CKPT as an existing --to export; write nothing"
    )
    p.set_defaults(func=run)
    return p


def default_out(ckpt: DraftCheckpoint, engine: str) -> Path:
    base = ckpt.run_dir if ckpt.run_dir is not None else ckpt.draft_dir.parent
    return base / f"export-{engine}"


def run(args: argparse.Namespace) -> int:
    """Export (unless --verify), then verify; print what was written and checked."""
    from draftsmith.export.verify import verify_export

    if args.verify:
        for line in verify_export(args.checkpoint, args.to):
            print(line)
        return 0
    ckpt = locate_checkpoint(args.checkpoint)
    out = Path(args.out) if args.out else default_out(ckpt, args.to)
    check_out(ckpt, args.to, out, args.overwrite)
    try:
        if ckpt.kind.read_for is not None:  # read for its target, exported from there
            with tempfile.TemporaryDirectory() as tmp:
                imported = import_peer_head(ckpt, args.target, Path(tmp))
                written = export_checkpoint(imported, args.to, out, args.gguf_dtype, args.target_gguf)
        else:
            written = export_checkpoint(ckpt, args.to, out, args.gguf_dtype, args.target_gguf)
    except Exception as err:  # noqa: BLE001 - a full disk said by a library (safetensors) carries no errno
        full = files.out_of_space(err)
        if not full and (
            not isinstance(err, OSError)
            or err.errno is None
            or isinstance(err, (FileNotFoundError, PermissionError, files.DiskFullError))
        ):
            raise
        why = "no space left on device" if full else (err.strerror or err)
        raise ValueError(  # a read-only or full file system found midway: one line, not a traceback
            f"could not write the export to {out} ({why}); nothing temporary was left behind. "
            "Free the place or pass another --out, then run the same command again"
        ) from err
    print(f"wrote {written}")
    for line in verify_export(written, args.to):
        print(line)
    return 0
