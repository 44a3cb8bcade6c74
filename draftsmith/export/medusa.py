"""What the Medusa kind brings to the engines (``drafts/base.KINDS`` names this module): vLLM's ``MedusaModel``
layout (``vllm/model_executor/models/medusa.py``: ``blocks.{head}.layers.{i}`` residual blocks,
``lm_heads.{head}``, one ``lm_head`` with ``original_lm_head``), its check and the card's vLLM section. The
other engines have no Medusa loader (the kind's record says so); ``--to hf`` is the family's own.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import MEDUSA
from draftsmith.drafts.engines import VLLM
from draftsmith.export.eagle import SOURCE_KEY
from draftsmith.export.engines import CardContext, ExportOptions, architecture_is, checked, register_family
from draftsmith.export.verify import _read_tensors, read_export_config
from draftsmith.export.vllm import serve_section

MEDUSA_ARCHITECTURE = "MedusaModel"


def medusa_tensors(state: dict[str, torch.Tensor], shared_lm_head: bool) -> dict[str, torch.Tensor]:
    """draftsmith's Medusa tensors under vLLM's names. The frozen final-norm copy is left out: vLLM hands
    Medusa the target's hidden state after its final norm, which is what draftsmith's heads read."""
    out = {}
    for name, tensor in state.items():
        m = re.fullmatch(r"heads\.(\d+)\.(\d+)\.linear\.(weight|bias)", name)
        if m:
            out[f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"] = tensor
        elif re.fullmatch(r"lm_heads\.\d+\.weight", name) or (shared_lm_head and name == "lm_head.weight"):
            out[name] = tensor
        elif name != "norm.weight":
            raise ValueError(f"a Medusa tensor vLLM has no place for: {name}")
    return out


def write_medusa(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    config = ckpt.config
    if config.get("logit_softcap"):
        raise ValueError(
            "--to vllm cannot take these Medusa heads: their target caps logits (final_logit_softcapping), which "
            "vLLM's Medusa does not (it scales them only); evaluate them with `draftsmith eval`"
        )
    with safe_open(str(ckpt.draft_dir / "model.safetensors"), "pt") as f:
        state = {name: f.get_tensor(name).contiguous() for name in f.keys()}  # noqa: SIM118
    shared = bool(config.get("shared_lm_head"))
    # vLLM's MedusaConfig.from_pretrained renames every key holding "num" and "heads" (or "layers") to
    # num_heads (num_hidden_layers): the config carries no other such key
    vllm_config = {
        "architectures": [MEDUSA_ARCHITECTURE], "model_type": "medusa", "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"], "num_heads": config["num_heads"],
        "num_hidden_layers": config["num_layers"], "truncated_vocab_size": config["vocab_size"],
        "medusa_fc_bias": True, "original_lm_head": shared, "torch_dtype": "float32",
        SOURCE_KEY: {"kind": ckpt.kind.name, "target": ckpt.target},
    }  # fmt: skip

    def write(tmp: Path) -> None:
        save_file(medusa_tensors(state, shared), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(files.json_text(vllm_config))

    return files.replace_dir(out, write, keep_others=True)


def verify_medusa_vllm(folder: Path) -> list[str]:
    """Problems a Medusa export has for vLLM 0.32's ``MedusaModel`` (model_executor/models/medusa.py,
    transformers_utils/configs/medusa.py): its loader keeps only names it has a parameter for (anything
    else is silently dropped, a missing one stays uninitialised), so every name and shape is checked."""
    config = read_export_config(folder)
    problems = []
    renamed = [k for k in config if "num" in k and ("heads" in k or "layers" in k)]
    if sorted(renamed) != ["num_heads", "num_hidden_layers"]:
        problems.append(
            f"config keys vLLM renames to num_heads / num_hidden_layers: {renamed} (need exactly those two)"
        )
    if config.get("truncated_vocab_size", config.get("vocab_size")) != config.get("vocab_size"):
        problems.append(
            "truncated_vocab_size below vocab_size needs a token_map, which draftsmith does not write"
        )
    H, V = config.get("hidden_size"), config.get("vocab_size")
    heads, layers = config.get("num_heads", 0), config.get("num_hidden_layers", 0)
    bias = bool(config.get("medusa_fc_bias", False))
    want = {f"blocks.{h}.layers.{i}.weight": (H, H) for h in range(heads) for i in range(layers)}
    if bias:
        want |= {f"blocks.{h}.layers.{i}.bias": (H,) for h in range(heads) for i in range(layers)}
    if config.get("original_lm_head", False):
        want["lm_head.weight"] = (V, H)
    else:
        want |= {f"lm_heads.{h}.weight": (V, H) for h in range(heads)}
    have = {name: tuple(t.shape) for name, t in _read_tensors(folder).items()}
    problems += [
        f"missing {n} {list(shape)} (vLLM would leave it uninitialised)"
        for n, shape in want.items()
        if n not in have
    ]
    problems += [f"{n} is {list(have[n])}, vLLM builds {list(shape)}" for n, shape in want.items()
                 if n in have and tuple(have[n]) != shape]  # fmt: skip
    problems += [f"{n}: vLLM's Medusa has no such parameter and drops it" for n in have if n not in want]
    return problems


def vllm_usage(card: CardContext) -> list[str]:
    """vLLM's Medusa drafts one token per head."""
    return serve_section(card, '"method": "medusa"', card.config.get("num_heads", card.k))


register_family(
    MEDUSA, VLLM, write_medusa, vllm_usage,
    (architecture_is(MEDUSA_ARCHITECTURE), checked("Medusa heads", verify_medusa_vllm)),
    help=f"Medusa: {MEDUSA_ARCHITECTURE}",
)  # fmt: skip
