"""DSpark drafts in vLLM 0.32's layout (``Qwen3DSparkModel``, ``model_executor/models/qwen3_dspark.py``).

DFlash's folder (``export/dflash_vllm.py``: the backbone's tensors and config) with the Markov head's two tensors
under vLLM's names (``markov_head.markov_w1.weight`` [V, r], indexed by target ids; ``markov_head.markov_w2.weight``
[Vd, r]), ``architectures: ["Qwen3DSparkModel"]``, ``markov_rank`` (read with no default), and draftsmith's
block as DSpark's fill-in layout: ``sample_from_anchor: false`` (slot 0 holds the last token, every later slot
is a draft) and ``block_size`` = the drafts per block (vLLM's default ``num_speculative_tokens``). No
confidence head is written (draftsmith does not train one; vLLM then drops it).

vLLM's CPU build cannot serve DSpark (it lives only in the Triton-based V2 model runner:
docs/studies/dspark_in_vllm_cpu.md), so ``verify_dspark_vllm`` checks the folder against that loader's
source, as DFlash's verifier does; llama.cpp here serves the same draft (``gguf_dflash.py``: llama.cpp's
``dflash`` architecture with ``markov_w1``/``markov_w2``). The two are what the DSpark kind registers onto the
engine records (``drafts/base.KINDS`` names this module); SGLang and speculators have no DSpark layout here.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import DSPARK
from draftsmith.drafts.engines import GGUF, VLLM
from draftsmith.export import gguf_dflash
from draftsmith.export.dflash import vllm_usage
from draftsmith.export.dflash_vllm import check_dflash_config, engine_tensors, vllm_config, write_folder
from draftsmith.export.eagle import SOURCE_KEY
from draftsmith.export.engines import ExportOptions, architecture_is, checked, register_family
from draftsmith.export.verify import _read_tensors, read_export_config

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_W1, MARKOV_W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"


def dspark_vllm_config(config: dict, target_layers: int) -> dict:
    """vLLM's config.json for a draftsmith DSpark config (as a dict)."""
    out = vllm_config(config, target_layers)
    return {
        **out,
        "architectures": [DSPARK_ARCHITECTURE],
        "block_size": int(config["block_size"]) - 1,  # drafts per block: slot 0 is the last committed token
        "markov_rank": int(config["markov_rank"]),
        "sample_from_anchor": False,
        "enable_confidence_head": False,
    }


def write_vllm(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """vLLM's ``Qwen3DSparkModel`` folder."""
    config = dspark_vllm_config(ckpt.config, int(ckpt.target.get("num_hidden_layers", 0)))
    config[SOURCE_KEY] = {"kind": ckpt.kind.name, "target": ckpt.target}
    return write_folder(out, config, engine_tensors(ckpt))


def verify_dspark_vllm(folder: Path) -> list[str]:
    """Problems a DSpark export has for vLLM 0.32 (``qwen3_dspark.py``, ``v1/worker/gpu/spec_decode/dspark``)."""
    config, tensors = read_export_config(folder), _read_tensors(folder)
    problems = []
    rank = config.get("markov_rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(
            f"markov_rank {rank!r}: vLLM reads it with no default and sizes the Markov head by it"
        )
        rank = None
    if config.get("sample_from_anchor") is not False:
        problems.append(
            f"sample_from_anchor {config.get('sample_from_anchor')!r}: draftsmith's blocks hold the last token "
            "in slot 0 (vLLM's default True would draft from slot 0 instead)"
        )
    V, Vd = config.get("vocab_size", 0), config.get("draft_vocab_size", config.get("vocab_size", 0))
    for name, shape in ((MARKOV_W1, (V, rank)), (MARKOV_W2, (Vd, rank))):
        if name not in tensors:
            problems.append(f"missing {name} (the Markov head vLLM's DSpark model loads)")
        elif rank is not None and tuple(tensors[name].shape) != shape:
            problems.append(f"{name} is {list(tensors[name].shape)}, vLLM builds {list(shape)}")
    # the backbone is DFlash's, with block_size counting the drafts (DFlash's counts the last token too)
    backbone = {**config, "block_size": int(config.get("block_size") or 0) + 1}
    rest = {name: t for name, t in tensors.items() if name not in (MARKOV_W1, MARKOV_W2)}
    return problems + check_dflash_config(backbone, rest)


register_family(
    DSPARK, VLLM, write_vllm, vllm_usage,
    (architecture_is(DSPARK_ARCHITECTURE), checked("DSpark draft", verify_dspark_vllm)),
    help=f"DSpark: {DSPARK_ARCHITECTURE} (vLLM's V2 model runner, which its CPU build lacks)",
)  # fmt: skip
register_family(DSPARK, GGUF, gguf_dflash.write_dflash, gguf_dflash.usage,
                help="DSpark: DFlash's architecture with the Markov head (needs the target's GGUF)")  # fmt: skip
