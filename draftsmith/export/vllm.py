"""The ``vllm`` engine's work: EAGLE-3 heads in the reference layout with vLLM's layer ids (``eagle.py``),
distilled drafts as their transformers directory (vLLM's ``draft_model`` method), Medusa heads in the
layout of vLLM's ``MedusaModel`` (``vllm/model_executor/models/medusa.py``: ``blocks.{head}.layers.{i}``
residual blocks, ``lm_heads.{head}``, one ``lm_head`` with ``original_lm_head``)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.base import DFLASH, DSPARK
from draftsmith.drafts.engines import VLLM
from draftsmith.export import copy_export
from draftsmith.export.dflash import DFLASH_ARCHITECTURE, verify_dflash_vllm
from draftsmith.export.dflash import write_vllm as write_dflash
from draftsmith.export.dspark import DSPARK_ARCHITECTURE, verify_dspark_vllm
from draftsmith.export.dspark import write_vllm as write_dspark
from draftsmith.export.eagle import SOURCE_KEY, export_eagle
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.verify import read_export_config, verify_reference_engine


def write_eagle(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    return export_eagle(ckpt, out, VLLM.name)


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


def usage(card: CardContext) -> list[str]:
    base, repo, k = card.base_model, card.repo_id, card.k
    if card.kind.family.name == "causal_lm":
        config, model = '"method": "draft_model"', f'"model": "{repo}"'
        export = []
    elif card.kind.family.name == "medusa":
        config, model = '"method": "medusa"', '"model": "draft-vllm"'
        k = card.config.get("num_heads", k)  # vLLM's Medusa drafts one token per head
        export = [f"draftsmith export {repo} --to vllm --out draft-vllm"]
    elif card.kind.family.name in (DFLASH, DSPARK):
        config, model = f'"method": "{card.kind.family.name}"', '"model": "draft-vllm"'
        k = card.config.get("block_size", k + 1) - 1  # one block: the last token and block_size - 1 drafts
        export = [f"draftsmith export {repo} --to vllm --out draft-vllm"]
    elif card.config.get("mask_token_id") is not None:  # P-EAGLE: the whole chain in one forward
        config, model = '"method": "eagle3", "parallel_drafting": true', '"model": "draft-vllm"'
        k = card.config.get("parallel_depths") or k
        export = [f"draftsmith export {repo} --to vllm --out draft-vllm"]
    else:
        config, model = '"method": "eagle3"', '"model": "draft-vllm"'
        export = [f"draftsmith export {repo} --to vllm --out draft-vllm"]
    return [
        "### vLLM",
        "",
        "```bash",
        *export,
        f"vllm serve {base} --speculative-config '{{{config}, {model}, \"num_speculative_tokens\": {k}}}'",
        "```",
        "",
    ]


def verify(folder: Path) -> tuple[str, list[str]]:
    """A DFlash or DSpark draft by its own checks (``export/dflash.py``, ``export/dspark.py``); anything else
    as the reference engines' exports."""
    architectures = read_export_config(folder).get("architectures")
    if architectures == [DFLASH_ARCHITECTURE]:
        return "DFlash draft", verify_dflash_vllm(folder)
    if architectures == [DSPARK_ARCHITECTURE]:
        return "DSpark draft", verify_dspark_vllm(folder)
    return verify_reference_engine(folder, VLLM)


VLLM.writers.update(
    {
        "eagle": write_eagle,
        "causal_lm": copy_export,
        "medusa": write_medusa,
        DFLASH: write_dflash,
        DSPARK: write_dspark,
    }  # fmt: skip
)
VLLM.verify, VLLM.usage = verify, usage
