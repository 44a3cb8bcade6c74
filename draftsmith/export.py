"""``draftsmith export CKPT --to hf|vllm|sglang|gguf``: a draft in the layout a serving engine loads.

Every export is checked afterwards by ``draftsmith.export_verify`` against what that engine's loader
reads; ``--verify`` checks an existing folder without exporting. Loader expectations, the versions
they were read from, and the layer-id and d2t conventions: docs/EXPORT.md.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from draftsmith import files
from draftsmith.draft_checkpoint import EAGLE, DraftCheckpoint, locate_checkpoint

ENGINES = ("hf", "vllm", "sglang", "speculators", "gguf")
TRAINING_FILES = {"train_state.json", "train_config.yaml"}
"""Files in a draft directory that describe the run, not the model: not part of an engine export."""

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
        "--verify", action="store_true", help="only verify CKPT as an existing --to export; write nothing"
    )
    p.set_defaults(func=run)
    return p


def default_out(ckpt: DraftCheckpoint, engine: str) -> Path:
    base = ckpt.run_dir if ckpt.run_dir is not None else ckpt.draft_dir.parent
    return base / f"export-{engine}"


def copy_causal_lm(ckpt: DraftCheckpoint, out: Path) -> None:
    """The draft's transformers directory as it is (weights, config, tokenizer), minus run records."""
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


def export_checkpoint(
    ckpt: DraftCheckpoint,
    engine: str,
    out: Path,
    gguf_dtype: str = "f16",
    target_gguf: str | None = None,
) -> Path:
    """Write ``ckpt`` for ``engine`` under ``out``; return the folder (or GGUF file) written."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    name = (ckpt.run_dir or ckpt.draft_dir).resolve().name
    gguf_file = out if out.suffix == ".gguf" else out / f"{name}-{gguf_dtype}.gguf"
    if ckpt.kind == EAGLE:
        if engine == "gguf":
            from draftsmith.eagle_export import check_exportable, read_weights
            from draftsmith.gguf_export import write_eagle3_gguf

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
        from draftsmith.eagle_export import export_eagle

        return export_eagle(ckpt, out, engine)
    if engine == "speculators":
        raise ValueError(
            "the speculators format holds EAGLE-3 heads; a distilled draft is an ordinary causal LM: "
            "export it with --to vllm (vLLM's draft_model method loads the transformers directory)"
        )
    if engine == "gguf":
        from draftsmith.gguf_export import write_gguf

        return write_gguf(ckpt.draft_dir, gguf_file, gguf_dtype, target_gguf_of(ckpt, target_gguf))
    return files.replace_dir(out, lambda tmp: copy_causal_lm(ckpt, tmp))


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
    written = export_checkpoint(ckpt, args.to, out, args.gguf_dtype, args.target_gguf)
    print(f"wrote {written}")
    for line in verify_export(written, args.to):
        print(line)
    return 0
