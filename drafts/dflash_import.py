"""DFlash drafts other pipelines wrote, read into draftsmith's ``DFlashDraft`` for a given target.

Two layouts are known, each learnt from the writer's own source:

- ``DFlashDraftModel`` (SpecForge 0.2.0's ``modeling/draft/dflash.py``, saved by its ``export --to hf``; vLLM
  0.32's ``qwen3_dflash.py`` loads the same, so draftsmith's own ``--to vllm`` export reads back too): a Qwen3
  config plus ``block_size``, ``layer_types`` and ``dflash_config`` {``target_layer_ids``, ``mask_token_id``};
  ids are layer outputs (SpecForge's ``extract_context_feature`` takes ``hidden_states[id + 1]``), draftsmith's
  convention. Tensors carry draftsmith's names; no embedding or LM head (the target's, as vLLM shares them).
- speculators 0.9.0's DFlash (``speculators_model_type: dflash``, ``models/dflash/core.py``): the decoder shape
  in ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` in vLLM's convention (id L = the input of
  layer L = draftsmith's L - 1), ``mask_token_id`` and ``block_size`` top-level; a reduced vocabulary keeps
  ``lm_head`` and ``d2t`` offsets (target id = draft id + d2t[draft id]), a full one neither.

Both compute what draftsmith's ``DFlashDraft`` computes (context through ``fc`` and ``hidden_norm`` into every
layer's keys / values, per-head ``q_norm`` / ``k_norm``, the block non-causal, ``norm`` at the end). What would
change that (sliding-window or causal layers, a sampled anchor, biases, scaled RoPE) is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.decode.drafter import Drafter
from draftsmith.drafts.base import PEER_DFLASH, DraftKind, register
from draftsmith.drafts.dflash import DFLASH_BLOCKS, DFlashConfig, DFlashDraft, DFlashDrafter
from draftsmith.drafts.eagle_import import HeadImportError, read_head_files
from draftsmith.drafts.taps import check_tap_layers

SPECULATORS_DFLASH = "dflash"
"""``speculators_model_type`` of a DFlash draft (speculators' own name; ``drafts/base.is_foreign_dflash``)."""
OWN_BUFFERS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t")
"""Tensors a peer may save that draftsmith takes from the target or rebuilds (the vocabulary map)."""


def _layout(config: dict) -> tuple[str, dict, list[int] | None, int | None]:
    """(the layout's title, its decoder config, the tapped layers as draftsmith counts them, the mask token)."""
    if config.get("speculators_model_type") == SPECULATORS_DFLASH:
        if config.get("sample_from_anchor"):
            raise HeadImportError(
                "sample_from_anchor is true: the draft also samples at the anchor, which draftsmith's block "
                "(and vLLM's DFlash) commits as the target's token"
            )
        ids = config.get("aux_hidden_state_layer_ids")
        layer = config.get("transformer_layer_config") or {}
        return (
            "speculators",
            layer,
            None if ids is None else [int(i) - 1 for i in ids],
            config.get("mask_token_id"),
        )
    dflash = config.get("dflash_config") or {}
    return (
        "DFlashDraftModel (SpecForge, vLLM)",
        config,
        dflash.get("target_layer_ids"),
        dflash.get("mask_token_id"),
    )


def _refusals(layer: dict, block_size) -> list[str]:
    """What in the decoder config draftsmith's DFlash layers would not compute as the writer did."""
    problems = []
    types = layer.get("layer_types")
    n = layer.get("num_hidden_layers")
    if types is not None and list(types) != ["full_attention"] * int(n or 0):
        problems.append(
            f"layer_types {types}: only full_attention layers attend non-causally over the whole block"
        )
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            problems.append(f"{key} is true: draftsmith's DFlash layers have no biases")
    if layer.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {layer['hidden_act']!r}: draftsmith's DFlash MLP is SiLU-gated")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"RoPE type {rope.get('rope_type', rope.get('type'))!r}: draftsmith reads plain RoPE")
    if not isinstance(block_size, int) or block_size < 2:
        problems.append(f"block_size {block_size!r}: a block holds the anchor and at least one slot")
    return problems


def import_dflash(target, path: str | Path) -> DFlashDraft:
    """The DFlash draft in directory ``path`` (a layout above) as a ``DFlashDraft`` for ``target``, frozen, on its
    device; everything it needs that the files do not say is refused, naming the field."""
    path = Path(path)
    config, tensors = read_head_files(path)
    title, layer, ids, mask = _layout(config)
    what = f"the {title} DFlash draft in {path}"
    block_size = config.get("block_size")
    problems = _refusals(layer, block_size)
    if ids is None:
        problems.append("no target layer ids (dflash_config.target_layer_ids / aux_hidden_state_layer_ids)")
    if mask is None:
        problems.append("no mask_token_id: the token its blocks were trained with is unknown")
    tcfg, V = target.config, target.vocab_size
    if layer.get("hidden_size") != tcfg.hidden_size or layer.get("vocab_size") != V:
        problems.append(f"hidden_size {layer.get('hidden_size')} / vocab_size {layer.get('vocab_size')}, the target "
                        f"{target.name!r} has {tcfg.hidden_size} / {V}: a draft for another target")  # fmt: skip
    if problems:
        raise HeadImportError(f"{what} cannot be read as it was trained: " + "; ".join(problems))
    rope = layer.get("rope_parameters") or {}
    heads = int(layer["num_attention_heads"])
    own_head = "lm_head.weight" in tensors and "d2t" in tensors
    draft_vocab = tensors["lm_head.weight"].shape[0] if own_head else V
    cfg = DFlashConfig(
        hidden_size=int(layer["hidden_size"]), intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=heads, num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or layer["hidden_size"] // heads),
        num_hidden_layers=int(layer["num_hidden_layers"]), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)), vocab_size=V,
        block_size=block_size, mask_token_id=int(mask), draft_vocab_size=draft_vocab,
        capture_layer_ids=check_tap_layers(list(ids), tcfg.num_hidden_layers), target=target.record(),
        imported_from={"layout": title, "path": str(path), "architectures": config.get("architectures")},
    )  # fmt: skip
    state = {name: t for name, t in tensors.items() if name not in OWN_BUFFERS}
    if own_head:  # draftsmith keeps absolute target ids in ascending order, the head's rows with them
        ids_abs = tensors["d2t"].long() + torch.arange(draft_vocab)
        order = ids_abs.argsort()
        state["lm_head.weight"], state["d2t"] = tensors["lm_head.weight"][order], ids_abs[order]
        state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids_abs, True)
    else:
        state.pop("lm_head.weight", None)  # a full vocabulary's head is the target's own
    draft = DFlashDraft(cfg)
    want = draft.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    wrong = [f"{n} {list(state[n].shape)} (expected {list(want[n].shape)})" for n in set(want) & set(state)
             if state[n].shape != want[n].shape]  # fmt: skip
    if missing or extra or wrong:
        raise HeadImportError(
            f"{what}: missing {missing}, not DFlash weights {extra}, mis-shaped {sorted(wrong)}"
        )
    draft.load_state_dict({k: v.to(want[k].dtype) for k, v in state.items()}, strict=True)
    return draft.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def _build(target, path: str) -> Drafter:
    return DFlashDrafter(import_dflash(target, path), target.model, name=f"{PEER_DFLASH}:{Path(path).name}")


register(DraftKind(PEER_DFLASH, "DFlash draft from another pipeline", _build, DFLASH_BLOCKS, target_key="target",
                   exports=(), refusal="export needs the draft read for its target first: pass --target",
                   read_for=import_dflash))  # fmt: skip
