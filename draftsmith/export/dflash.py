"""What the DFlash kind brings to each engine, registered onto the engine records (``drafts/base.KINDS`` names
this module; ``export/engines.loaded`` imports it): its writer, the check of what it wrote and the model
card's section.

- vLLM: its ``DFlashDraftModel`` folder (``dflash_vllm.py``), served with ``"method": "dflash"``;
- SGLang: the same folder, SpecForge's exporter's layout for SGLang (its ``export --to hf``), refused for a
  draft that reads the target's last layer (SGLang marks ``layers[id + 1]`` to capture; a target has no
  layer L). SGLang does not run here: the layout is judged by SpecForge's own class (tests/test_dflash_peers.py);
- speculators: ``DFlashSpeculator`` (``dflash_speculators.py``);
- llama.cpp: its ``dflash`` architecture (``gguf_dflash.py``).
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import DFLASH
from draftsmith.drafts.engines import GGUF, SGLANG, SPECULATORS, VLLM
from draftsmith.drafts.taps import refuse_uncaptured_last_layer
from draftsmith.export import gguf_dflash
from draftsmith.export.dflash_speculators import (
    DFLASH_TYPE,
    verify_dflash_speculators,
    write_dflash_speculators,
)
from draftsmith.export.dflash_vllm import DFLASH_ARCHITECTURE, verify_dflash_vllm, write_vllm
from draftsmith.export.engines import CardContext, ExportOptions, architecture_is, checked, register_family
from draftsmith.export.vllm import serve_section


def vllm_usage(card: CardContext) -> list[str]:
    """vLLM serving a block drafter's folder: one block a step (the last token and block_size - 1 drafts), the
    method named as the family."""
    k = int(card.config.get("block_size", card.k + 1)) - 1
    return serve_section(card, f'"method": "{card.kind.family.name}"', k)


def sglang_usage(card: CardContext) -> list[str]:
    """Not run here: no command draftsmith has not seen work, only where the layout goes."""
    return [
        "### SGLang",
        "",
        f"`draftsmith export {card.repo_id} --to sglang --out draft-sglang` writes SpecForge's `DFlashDraftModel` "
        "folder, the layout SpecForge's exporter gives SGLang; serve it as SGLang's DFlash documentation says "
        f"(a block drafts {int(card.config.get('block_size', 2)) - 1} tokens).",
        "",
    ]


def write_sglang(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """vLLM's ``DFlashDraftModel`` folder, refused for a draft that reads the target's last layer."""
    refuse_uncaptured_last_layer(
        list(ckpt.config.get("capture_layer_ids") or []), int(ckpt.target.get("num_hidden_layers", 0)), SGLANG
    )
    return write_vllm(ckpt, out, options)


IS_VLLM_FOLDER = (architecture_is(DFLASH_ARCHITECTURE), checked("DFlash draft", verify_dflash_vllm))
register_family(DFLASH, VLLM, write_vllm, vllm_usage, IS_VLLM_FOLDER, help="DFlash: DFlashDraftModel")
register_family(DFLASH, SGLANG, write_sglang, sglang_usage, IS_VLLM_FOLDER,
                help="DFlash: SpecForge's DFlashDraftModel folder")  # fmt: skip
register_family(
    DFLASH, SPECULATORS, write_dflash_speculators,
    verifier=(lambda config: config.get("speculators_model_type") == DFLASH_TYPE,
              checked("DFlash draft (speculators format)", verify_dflash_speculators)),
    help="DFlash: DFlashSpeculator",
)  # fmt: skip
register_family(DFLASH, GGUF, gguf_dflash.write_dflash, gguf_dflash.usage,
                help="DFlash: its dflash architecture (needs the target's GGUF, --target-gguf)")  # fmt: skip
