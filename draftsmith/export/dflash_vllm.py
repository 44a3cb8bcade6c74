"""DFlash drafts in vLLM 0.32's layout (``DFlashDraftModel``, ``model_executor/models/qwen3_dflash.py``).

The tensors keep draftsmith's names, which are vLLM's (``layers.{i}.self_attn.{q,k,v,o}_proj``, per-head
``q_norm`` / ``k_norm``, ``mlp.{gate,up,down}_proj``, the two layer norms, ``fc``, ``hidden_norm``, ``norm``);
the token embedding and LM head are left out, so vLLM shares the target's, as draftsmith does. The config
is a Qwen3 config plus ``block_size``, ``layer_types`` (all full attention: vLLM then attends non-causally)
and ``dflash_config`` {``mask_token_id``, ``target_layer_ids``} in DFlash's own convention (id i = output
of decoder layer i, draftsmith's too; vLLM adds one for its auxiliary layers). ``verify_dflash_vllm`` checks
an export against that loader, which leaves a missing tensor uninitialised and reads no field it lacks
without a default.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.export.eagle import SOURCE_KEY
from draftsmith.export.engines import ExportOptions
from draftsmith.export.verify import _read_tensors, read_export_config

DFLASH_ARCHITECTURE = "DFlashDraftModel"
FULL_ATTENTION = "full_attention"
CONFIG_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "num_hidden_layers", "max_position_embeddings", "vocab_size", "block_size")  # fmt: skip


def vllm_config(config: dict, target_layers: int) -> dict:
    """vLLM's config.json for a draftsmith DFlash config (draftsmith's ``DFlashConfig`` as a dict)."""
    theta = float(config["rope_theta"])
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        **{key: int(config[key]) for key in CONFIG_INTS},
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": theta,  # vLLM's fallback is 1e6, not the target's
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"]),
        "layer_types": [FULL_ATTENTION] * int(config["num_hidden_layers"]),
        "num_target_layers": target_layers,
        "dflash_config": {
            "mask_token_id": int(config["mask_token_id"]),
            "target_layer_ids": list(config["capture_layer_ids"]),
        },
        "torch_dtype": "float32",
    }


def engine_tensors(ckpt: DraftCheckpoint) -> dict[str, torch.Tensor]:
    """The draft's tensors as vLLM and speculators name them: draftsmith's names, float32, ``d2t`` as offsets
    (target id = draft id + d2t[draft id]) and no ``t2d`` (both rebuild it)."""
    with safe_open(str(ckpt.draft_dir / "model.safetensors"), "pt") as f:
        state = {name: f.get_tensor(name).float().contiguous() for name in f.keys()}  # noqa: SIM118
    state.pop("t2d", None)
    if "d2t" in state:
        d2t = state["d2t"].long()
        state["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()
    return state


def write_folder(out: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(files.json_text(config))

    return files.replace_dir(out, write, keep_others=True)


def write_vllm(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """vLLM's ``DFlashDraftModel`` folder; also SpecForge's (``export --to hf`` of its DFlash, which it points
    SGLang users to), so ``--to sglang`` writes the same."""
    config = vllm_config(ckpt.config, int(ckpt.target.get("num_hidden_layers", 0)))
    config[SOURCE_KEY] = {"kind": ckpt.kind.name, "target": ckpt.target}
    return write_folder(out, config, engine_tensors(ckpt))


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM 0.32's DFlash model loads from a draft without its own embedding or LM head."""
    H, d = config.get("hidden_size", 0), config.get("head_dim", 0)
    heads, kv, inter = (
        config.get("num_attention_heads", 0),
        config.get("num_key_value_heads", 0),
        config.get("intermediate_size", 0),
    )
    taps = len((config.get("dflash_config") or {}).get("target_layer_ids") or [])
    want = {"fc.weight": (H, taps * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    V, Vd = config.get("vocab_size", 0), config.get("draft_vocab_size", config.get("vocab_size", 0))
    if Vd < V:  # a head of its own over the draft vocabulary, and vLLM's draft_id_to_target_id
        want |= {"lm_head.weight": (Vd, H), "d2t": (Vd,)}
    for i in range(config.get("num_hidden_layers", 0)):
        p = f"layers.{i}."
        want |= {
            p + "self_attn.q_proj.weight": (heads * d, H), p + "self_attn.k_proj.weight": (kv * d, H),
            p + "self_attn.v_proj.weight": (kv * d, H), p + "self_attn.o_proj.weight": (H, heads * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter), p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }  # fmt: skip
    return want


def verify_dflash_vllm(folder: Path) -> list[str]:
    """Problems a DFlash export has for vLLM 0.32 (``qwen3_dflash.py``, ``v1/spec_decode/dflash.py``)."""
    return check_dflash_config(read_export_config(folder), _read_tensors(folder))


def check_dflash_config(config: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Problems of a ``DFlashDraftModel`` config.json (as a dict) and its tensors for vLLM 0.32's loader."""
    problems = [
        f"{key} missing from config.json" for key in CONFIG_INTS if not isinstance(config.get(key), int)
    ]
    if config.get("model_type") != "qwen3":
        problems.append(
            f"model_type {config.get('model_type')!r}: vLLM builds the DFlash layers from a qwen3 config"
        )
    if "eagle_config" in config:
        problems.append("an eagle_config key: vLLM merges it under dflash_config and its layer ids win")
    rope = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    if rope is None:
        problems.append("no rope_theta: vLLM falls back to 1e6, not the target's")
    dflash = config.get("dflash_config") or {}
    mask, ids = dflash.get("mask_token_id"), dflash.get("target_layer_ids")
    if not isinstance(mask, int) or not 0 <= mask < config.get("vocab_size", 0):
        problems.append(f"dflash_config.mask_token_id {mask!r} is not a token id of the vocabulary")
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])):
        problems.append(f"dflash_config.target_layer_ids {ids!r} must be a strictly increasing list")
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and ids and list(aux) != [i + 1 for i in ids]:
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {aux} wins over target_layer_ids {ids} (+1) and disagrees"
        )
    layers = config.get("num_hidden_layers", 0)
    if config.get("layer_types") != [FULL_ATTENTION] * layers:
        problems.append(
            f"layer_types {config.get('layer_types')!r}: every layer must be {FULL_ATTENTION} (non-causal)"
        )
    want = expected_tensors(config)
    have = {name: tuple(t.shape) for name, t in tensors.items()}
    problems += [
        f"missing {n} {list(s)} (vLLM would leave it uninitialised)" for n, s in want.items() if n not in have
    ]
    problems += [f"{n} is {list(have[n])}, vLLM builds {list(s)}" for n, s in want.items()
                 if n in have and have[n] != s]  # fmt: skip
    problems += [f"{n}: vLLM's DFlash model has no such parameter" for n in have
                 if n not in want and n not in ("embed_tokens.weight", "lm_head.weight")]  # fmt: skip
    V, Vd = config.get("vocab_size", 0), config.get("draft_vocab_size", config.get("vocab_size", 0))
    if "d2t" in have and Vd < V:
        d2t = tensors["d2t"].long()
        ids = d2t + torch.arange(d2t.numel())
        if d2t.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V or bool((ids[1:] <= ids[:-1]).any())):
            problems.append(
                "d2t is not offsets to distinct target ids in ascending order (target id = i + d2t[i])"
            )
    return problems
