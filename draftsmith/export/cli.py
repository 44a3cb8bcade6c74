"""``draftsmith export CKPT --to hf|vllm|sglang|speculators|gguf``: the command line of ``draftsmith.export``."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint, locate_checkpoint
from draftsmith.drafts.base import PEER_EAGLE3
from draftsmith.export import ENGINES, check_out, export_checkpoint, import_peer_head

DESCRIPTION = """\
Export a draft checkpoint (a `draftsmith train` run directory, its draft/ directory, or a Hub id) in
the layout an engine loads, then verify the result against what that engine's loader reads.

EAGLE-3 heads (layer ids written in ascending order, fc's columns permuted to match, as engines
concatenate the captured states in ascending layer order):
  --to hf           draftsmith's transformers layout (EagleHead.from_pretrained; `draftsmith eval --draft DIR`)
  --to vllm         LlamaForCausalLMEagle3 with top-level eagle_aux_hidden_state_layer_ids in vLLM's convention
                    (id L = input of target layer L = draftsmith id + 1); d2t as offsets, and no d2t at all
                    for a full draft vocabulary (vLLM's loader raises on one)
  --to speculators  Eagle3Speculator (the speculators format vLLM's docs point to), same conventions as vllm
  --to sglang       LlamaForCausalLMEagle3 with eagle_config.eagle_aux_hidden_state_layer_ids in SGLang's
                    convention (= draftsmith's: output of layer i) and d2t as offsets
  --to gguf         one GGUF file in llama.cpp's eagle3 architecture (llama-server --spec-type draft-eagle3);
                    needs the GGUF of the head's target (--target-gguf; known for smollm2-135m-instruct)
Distilled small drafts (ordinary causal LMs):
  --to hf / vllm / sglang   the transformers directory (assistant_model; vLLM/SGLang draft model)
  --to gguf    one GGUF file for llama.cpp / LM Studio (Llama architecture only)
Medusa drafts and EAGLE-1 heads: --to hf only (the engines have no loader for them; the error says why)
EAGLE-3 heads other pipelines wrote (SpecForge/SGLang, ModelOpt, speculators, SafeAILab/EAGLE): give --target;
  the head is read into draftsmith's layout for it (docs/EXPORT.md, "Reading heads from other pipelines")

Loader versions and conventions: docs/EXPORT.md."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``export`` subcommand; ``args.func`` runs it."""
    p = subparsers.add_parser(
        "export",
        help="export a draft in the layout transformers, vLLM, SGLang or llama.cpp loads",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="run directory, draft directory or Hub id (or, with --verify, an export)",
    )
    p.add_argument("--to", required=True, choices=ENGINES, help="the engine whose loader the export targets")
    p.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="output folder (created; for gguf a folder or a .gguf path); default: <run dir>/export-<engine>",
    )
    p.add_argument(
        "--gguf-dtype",
        choices=["f32", "f16", "q8_0"],
        default="f16",
        help="GGUF weight type (default f16; norms stay f32)",
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
        help="replace an earlier export at --out (a folder holding one, or a .gguf file); never anything else",
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
    if ckpt.kind.name == PEER_EAGLE3:  # read into draftsmith's layout for its target, exported from there
        with tempfile.TemporaryDirectory() as tmp:
            imported = import_peer_head(ckpt, args.target, Path(tmp))
            written = export_checkpoint(imported, args.to, out, args.gguf_dtype, args.target_gguf)
    else:
        written = export_checkpoint(ckpt, args.to, out, args.gguf_dtype, args.target_gguf)
    print(f"wrote {written}")
    for line in verify_export(written, args.to):
        print(line)
    return 0
