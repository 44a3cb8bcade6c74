"""``draftsmith export CKPT --to hf|vllm|sglang|gguf``: a draft in the layout a serving engine loads.

Every export is checked afterwards by ``draftsmith.export_verify`` against what that engine's loader
reads; ``--verify`` checks an existing folder without exporting. Loader expectations, the versions
they were read from, and the layer-id and d2t conventions: docs/EXPORT.md.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from draftsmith.draft_checkpoint import EAGLE, DraftCheckpoint, locate_checkpoint

ENGINES = ("hf", "vllm", "sglang", "gguf")
TRAINING_FILES = {"train_state.json", "train_config.yaml"}
"""Files in a draft directory that describe the run, not the model: not part of an engine export."""

DESCRIPTION = """\
Export a draft checkpoint (a `draftsmith train` run directory, its draft/ directory, or a Hub id) in
the layout an engine loads, then verify the result against what that engine's loader reads.

EAGLE-3 heads:
  --to hf      draftsmith's transformers layout (EagleHead.from_pretrained; `draftsmith eval --draft DIR`)
  --to vllm    LlamaForCausalLMEagle3 with top-level eagle_aux_hidden_state_layer_ids in vLLM's convention
               (id L = input of target layer L = draftsmith id + 1) and d2t as offsets
  --to sglang  LlamaForCausalLMEagle3 with eagle_config.eagle_aux_hidden_state_layer_ids in SGLang's
               convention (= draftsmith's: output of layer i) and d2t as offsets
Distilled small drafts (ordinary causal LMs):
  --to hf / vllm / sglang   the transformers directory (assistant_model; vLLM/SGLang draft model)
  --to gguf    one GGUF file for llama.cpp / LM Studio (Llama architecture only)

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
        "--tokenizer-gguf",
        metavar="FILE",
        default=None,
        help="copy the GGUF tokenizer metadata from this GGUF of the target (default: the bundled SmolLM2 GGUF for "
        "drafts of smollm2-135m-instruct, else written from the draft's tokenizer)",
    )
    p.add_argument(
        "--verify", action="store_true", help="only verify CKPT as an existing --to export; write nothing"
    )
    p.set_defaults(func=run)
    return p


def default_out(ckpt: DraftCheckpoint, engine: str) -> Path:
    base = ckpt.run_dir if ckpt.run_dir is not None else ckpt.draft_dir.parent
    return base / f"export-{engine}"


def copy_causal_lm(ckpt: DraftCheckpoint, out: Path) -> list[Path]:
    """The draft's transformers directory as it is (weights, config, tokenizer), minus run records."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file in sorted(ckpt.draft_dir.iterdir()):
        if file.is_file() and file.name not in TRAINING_FILES and not file.name.startswith("."):
            shutil.copy2(file, out / file.name)
            written.append(out / file.name)
    return written


def tokenizer_source(ckpt: DraftCheckpoint, given: str | None) -> Path | None:
    """The GGUF to copy tokenizer metadata from: --tokenizer-gguf, else the bundled target's when it is the one."""
    if given:
        if not Path(given).is_file():
            raise FileNotFoundError(f"--tokenizer-gguf {given} does not exist")
        return Path(given)
    from draftsmith.decode.target import SMOLLM2_ALIAS, smollm2_gguf_path

    if ckpt.target.get("name") == SMOLLM2_ALIAS:
        return smollm2_gguf_path()
    return None


def export_checkpoint(
    ckpt: DraftCheckpoint,
    engine: str,
    out: Path,
    gguf_dtype: str = "f16",
    tokenizer_gguf: str | None = None,
) -> Path:
    """Write ``ckpt`` for ``engine`` under ``out``; return the folder (or GGUF file) written."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if ckpt.kind == EAGLE:
        if engine == "gguf":
            raise ValueError(
                "EAGLE heads do not export to GGUF: they read the target's hidden states, which llama.cpp does "
                "not hand to a draft model. Export a distilled small draft to GGUF, or an EAGLE-3 head to vllm/sglang."
            )
        from draftsmith.eagle_export import export_eagle

        export_eagle(ckpt, out, engine)
        return out
    if engine == "gguf":
        from draftsmith.gguf_export import write_gguf

        name = (ckpt.run_dir or ckpt.draft_dir).resolve().name
        file = out if out.suffix == ".gguf" else out / f"{name}-{gguf_dtype}.gguf"
        return write_gguf(ckpt.draft_dir, file, gguf_dtype, tokenizer_source(ckpt, tokenizer_gguf))
    copy_causal_lm(ckpt, out)
    return out


def run(args: argparse.Namespace) -> int:
    """Export (unless --verify), then verify; print what was written and checked."""
    from draftsmith.export_verify import verify_export

    if args.verify:
        for line in verify_export(args.checkpoint, args.to):
            print(line)
        return 0
    ckpt = locate_checkpoint(args.checkpoint)
    out = Path(args.out) if args.out else default_out(ckpt, args.to)
    if out.exists() and out.is_dir() and any(out.iterdir()) and out.suffix != ".gguf":
        raise ValueError(f"--out {out} exists and is not empty; pass a new folder (exports are never merged)")
    written = export_checkpoint(ckpt, args.to, out, args.gguf_dtype, args.tokenizer_gguf)
    print(f"wrote {written}")
    for line in verify_export(written, args.to):
        print(line)
    return 0
