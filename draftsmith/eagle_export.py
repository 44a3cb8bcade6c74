"""EAGLE-3 heads in the layout vLLM's and SGLang's EAGLE-3 loaders read (see docs/EXPORT.md).

Both engines load the reference EAGLE-3 layout (``LlamaForCausalLMEagle3``): ``fc`` fuses the three
captured target states, one ``midlayer`` whose attention reads ``[input_layernorm(emb),
hidden_norm(feature)]``, ``norm`` and a reduced-vocabulary ``lm_head``; ``d2t`` holds OFFSETS (target
id = draft id + d2t[draft id]) where draftsmith stores absolute ids. They differ in one thing: where
the auxiliary layer ids live and what they count.

- vLLM: top-level ``eagle_aux_hidden_state_layer_ids``; id L = the input of decoder layer L
  (= the output of layer L-1), so draftsmith id i becomes i + 1.
- SGLang: ``eagle_config.eagle_aux_hidden_state_layer_ids``; id i = the output of layer i (SGLang adds
  1 itself when it captures), the same convention as draftsmith.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.decode.features import LAYER_ID_CONVENTION
from draftsmith.draft_checkpoint import EAGLE, DraftCheckpoint

ARCHITECTURE = "LlamaForCausalLMEagle3"
SOURCE_KEY = "draftsmith_source"
"""Exported configs record the head's own layer ids and target here (loaders ignore unknown keys)."""

# draftsmith EagleHead tensor name -> reference EAGLE-3 name (one decoder layer, the "midlayer")
NAME_MAP = {
    "embed_tokens.weight": "embed_tokens.weight",
    "fuse_features.weight": "fc.weight",
    "layers.0.layer.input_layernorm.weight": "midlayer.input_layernorm.weight",
    "layers.0.feature_norm.weight": "midlayer.hidden_norm.weight",
    "layers.0.layer.post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    **{f"layers.0.layer.self_attn.{p}_proj.weight": f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"},
    **{
        f"layers.0.layer.mlp.{p}_proj.weight": f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    },
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}


def engine_layer_ids(layer_ids: list[int], engine: str) -> list[int]:
    """draftsmith ids ("output of layer i, 0-based") → the ids ``engine`` expects in its config."""
    if engine == "vllm":
        return [i + 1 for i in layer_ids]
    if engine == "sglang":
        return list(layer_ids)
    raise ValueError(f"no EAGLE-3 layer-id convention for engine {engine!r}")


def check_exportable(config: dict, engine: str) -> None:
    """Refuse heads the engine's EAGLE-3 loader cannot represent, with the reason."""
    if config.get("preset") != "eagle3":
        raise ValueError(
            f"only EAGLE-3 heads export to {engine}; this head is preset {config.get('preset')!r} (draftsmith's "
            "EAGLE-1 head keeps the first layer's input norm and reads the target's norm, which the engines' "
            "EAGLE-1 loaders do not). Train an eagle3 head, or use it with `draftsmith eval`."
        )
    if config.get("num_decoder_layers", 1) != 1:
        raise ValueError(
            f"the head has {config['num_decoder_layers']} decoder layers; the {engine} EAGLE-3 layout exported "
            "here has exactly one (midlayer). Train with draft.options.num_decoder_layers: 1."
        )
    ids = list(config.get("capture_layer_ids") or [])
    if len(ids) != 3:
        raise ValueError(
            f"{engine}'s EAGLE-3 loader fuses exactly 3 target layers (fc reads 3 x target_hidden_size); this "
            f"head reads {len(ids)}: {ids}"
        )
    if config.get("layer_id_convention") != LAYER_ID_CONVENTION:
        raise ValueError(
            f"the head records layer ids in convention {config.get('layer_id_convention')!r}, expected "
            f"{LAYER_ID_CONVENTION!r}; re-save it with this version of draftsmith"
        )
    n_layers = (config.get("target") or {}).get("num_hidden_layers")
    if n_layers is None:
        raise ValueError(
            "the head records no target layer count (config.target); re-save it with `draftsmith train`"
        )
    if max(ids) > n_layers - 2:
        raise ValueError(
            f"layer id {max(ids)} is the output of the target's last layer ({n_layers} layers): vLLM and SGLang "
            "capture the input of a decoder layer, so they can only provide outputs of layers 0.."
            f"{n_layers - 2}. Train the head with capture_layer_ids below {n_layers - 1}."
        )
    if config.get("lm_head_is_embedding") or config.get("logit_softcap"):
        raise ValueError("EAGLE-3 heads exported to engines need their own LM head and no logit softcap")


def read_weights(draft_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the draft directory's safetensors files (sharded or not)."""
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{draft_dir} has no *.safetensors weights; re-save the draft with save_pretrained"
        )
    weights = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            weights.update({name: f.get_tensor(name) for name in f.keys()})
    return weights


def reference_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """draftsmith EagleHead tensors → reference EAGLE-3 tensors (names mapped, d2t as offsets)."""
    unknown = sorted(set(weights) - set(NAME_MAP))
    missing = sorted(set(NAME_MAP) - set(weights))
    if unknown or missing:
        raise ValueError(
            f"the EAGLE head's weights do not match the one-layer EAGLE-3 layout: unknown {unknown}, missing {missing}"
        )
    out = {NAME_MAP[name]: tensor.contiguous() for name, tensor in weights.items()}
    d2t = weights["d2t"].long()
    out["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()  # absolute ids -> offsets
    out["t2d"] = weights["t2d"].bool().contiguous()
    return out


def reference_config(config: dict, engine: str, dtype: torch.dtype) -> dict:
    """The config.json the engine's EAGLE-3 loader reads, with draftsmith's own record alongside."""
    target = config["target"]
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config["hidden_size"],
        "target_hidden_size": target["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_theta"],
        "rope_scaling": None,
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "draft_vocab_size": config["draft_vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    ids = engine_layer_ids(config["capture_layer_ids"], engine)
    if engine == "vllm":
        out["eagle_aux_hidden_state_layer_ids"] = ids
        out["norm_before_residual"] = False  # the residual is the fused feature before hidden_norm
    else:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    out[SOURCE_KEY] = {
        "engine": engine,
        "capture_layer_ids": list(config["capture_layer_ids"]),
        "layer_id_convention": config["layer_id_convention"],
        "d2t": "offsets (target id = draft id + d2t[draft id])",
        "target": target,
    }
    return out


def export_eagle(ckpt: DraftCheckpoint, out: Path, engine: str) -> list[Path]:
    """Write ``ckpt`` (an EAGLE head) into ``out`` for ``engine`` (hf, vllm or sglang); return the files."""
    if ckpt.kind != EAGLE:
        raise ValueError(f"{ckpt.draft_dir} is not an EAGLE head")
    out.mkdir(parents=True, exist_ok=True)
    if engine == "hf":  # draftsmith's own transformers layout: EagleHead.from_pretrained reads it
        files = [ckpt.draft_dir / "config.json", *sorted(ckpt.draft_dir.glob("*.safetensors"))]
        files += sorted(ckpt.draft_dir.glob("*.safetensors.index.json"))
        for file in files:
            shutil.copy2(file, out / file.name)
        return [out / f.name for f in files]
    check_exportable(ckpt.config, engine)
    weights = reference_weights(read_weights(ckpt.draft_dir))
    dtype = weights["fc.weight"].dtype
    config = reference_config(ckpt.config, engine, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in ("config.json", "model.safetensors"):
        os.chmod(out / file, 0o644)  # safetensors writes owner-only; an export is meant to be shared
    return [out / "config.json", out / "model.safetensors"]
