"""EAGLE-3 heads other pipelines wrote, read into draftsmith's ``EagleHead`` for a given target.

Three layouts are known, each learnt from the writer's own source (versions in docs/EXPORT.md):

- ``reference``: the SafeAILab/EAGLE layout (``yuhuili/EAGLE3-*``, whose configs say ``LlamaForCausalLM``)
  that SpecForge's ``export --to sglang`` (``LlamaForCausalLMEagle3``) and SGLang's loader share: ``fc``,
  ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``; often no token embedding (the target's is used). Layer ids, when given, sit in
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (output of layer i, draftsmith's convention) or, as
  draftsmith's vLLM export writes them, top-level (input of layer L); when absent, the layout's own
  default: the reference code captures the inputs of layers 2, N/2, N-3 (outputs 1, N/2-1, N-4), and
  SpecForge and SGLang default to the same layers.
- ``modelopt``: NVIDIA ModelOpt's ``export_hf_checkpoint``: ``LlamaForCausalLMEagle3`` with ModelOpt's
  ``eagle_config`` flags, tensors ``layers.N.*``, ``d2t`` only. Its ids are 0-based layer outputs
  (forward hooks on the decoder layers). ModelOpt's Hugging Face head normalizes the feature twice
  (the first layer's ``input_layernorm``, then ``hidden_norm``), which ``feature_input_norm`` reproduces.
  The YaRN scaling its export adds for long-context serving was not trained with and is left out.
- ``speculators``: ``Eagle3DraftModel`` / ``Eagle3Speculator`` with ``speculators_config``; decoder shape in
  ``transformer_layer_config``, ids top-level in vLLM's convention (input of layer L; L = N is the last
  layer's output), options ``norm_before_residual``, ``norm_before_fc``, ``norm_output``.

Every layout's ``d2t`` holds offsets (target id = draft id + d2t[draft id]); draftsmith stores absolute ids
in ascending order. Every engine concatenates the captured states in ascending layer order, so ``fc``'s
column blocks are read in that order. Anything the head needs that cannot be mapped is refused, naming
the field; nothing is skipped or guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.decode.drafter import Drafter
from draftsmith.drafts.base import PEER_EAGLE3, DraftKind, register
from draftsmith.drafts.eagle import EAGLE, EagleConfig, EagleHead
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.engines import MODELOPT, REFERENCE_EAGLE3, SPECULATORS, Engine, read_layouts

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_EAGLE3 = "eagle3"
"""``speculators_model_type`` of an EAGLE-3 head (speculators' own name, not a draftsmith kind)."""
SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel", "Eagle3Speculator")
MODELOPT_EAGLE_FIELDS = ("use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm",
                         "next_layer_regular", "parallel_draft_step")  # fmt: skip
"""``eagle_config`` keys only ModelOpt's export template writes."""
LAYER_PARTS = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
] + ["post_attention_layernorm.weight"]  # fmt: skip
"""Tensors of every decoder layer of the head (the first adds input_layernorm and hidden_norm)."""


class HeadImportError(ValueError):
    """A head from another pipeline that draftsmith cannot run as its writer ran it; the message names why."""


def read_head_files(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor of a head directory (safetensors shards, or a reference pytorch_model.bin)."""
    config = json.loads((path / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(str(file)))
    else:
        for file in sorted(path.glob("pytorch_model*.bin")):
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    if not tensors:
        raise HeadImportError(f"{path} has no weights (*.safetensors or pytorch_model.bin)")
    return config, tensors


def seen_fields(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """What a layout we do not know holds, for the error that says so."""
    names = sorted(
        {".".join(n.split(".")[:2]) if n.startswith("layers.") else n.split(".")[0] for n in tensors}
    )
    return f"architectures {config.get('architectures')!r}, config fields {sorted(config)}, tensors {names}"


def is_speculators(config: dict, tensors: dict[str, torch.Tensor]) -> bool:
    arch = config.get("architectures") or []
    if config.get("speculators_model_type") or any(a in SPECULATORS_ARCHITECTURES for a in arch):
        if config.get("speculators_model_type", SPECULATORS_EAGLE3) != SPECULATORS_EAGLE3:
            raise HeadImportError(
                f"speculators_model_type {config['speculators_model_type']!r} is not an EAGLE-3 head"
            )
        return True
    return False


def is_reference(config: dict, tensors: dict[str, torch.Tensor]) -> bool:
    # the SafeAILab checkpoints say LlamaForCausalLM, SpecForge LlamaForCausalLMEagle3
    return "fc.weight" in tensors and any(n.startswith("midlayer.") for n in tensors)


def is_modelopt(config: dict, tensors: dict[str, torch.Tensor]) -> bool:
    eagle = config.get("eagle_config") or {}
    return EAGLE3_ARCHITECTURE in (config.get("architectures") or []) and (
        any(key in eagle for key in MODELOPT_EAGLE_FIELDS) or any(n.startswith("layers.0.") for n in tensors)
    )


SPECULATORS.detect, REFERENCE_EAGLE3.detect, MODELOPT.detect = is_speculators, is_reference, is_modelopt


def detect_layout(config: dict, tensors: dict[str, torch.Tensor]) -> Engine:
    """Which known layout (its record, ``drafts/engines.py``) a head directory is in; an error naming the
    fields seen otherwise."""
    for layout in read_layouts():
        if layout.detect(config, tensors):
            return layout
    raise HeadImportError(
        "not an EAGLE-3 layout draftsmith knows (the reference/SpecForge/SGLang layout, ModelOpt's export, the "
        f"speculators format); seen: {seen_fields(config, tensors)}"
    )


def engine_guesses(n_layers: int) -> str:
    """What each engine reads when a head names no target layers (their defaults, from their source)."""
    ids = [2, n_layers // 2, n_layers - 3]
    return (
        f"vLLM would capture (2, N/2, N-3) = {ids} in its convention (input of layer L), SGLang the same layers "
        f"(set_eagle3_layers_to_capture(None)), and llama.cpp's convert_hf_to_gguf.py, which reads only the "
        f"top-level field, writes {ids} into eagle3.target_layers: all three mean the outputs of layers "
        f"{[i - 1 for i in ids]} of this {n_layers}-layer target"
    )


def layer_ids(config: dict, layout: Engine, n_layers: int, notes: list[str]) -> list[int]:
    """The target layers the head reads, as draftsmith ids (output of layer i, 0-based), ascending."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if layout is REFERENCE_EAGLE3 and None not in (nested, top) and nested != [i - 1 for i in top]:
        raise HeadImportError(
            f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang's: output of layer i) and the top-level "
            f"eagle_aux_hidden_state_layer_ids {top} (vLLM's: input of layer L) name different layers"
        )
    if layout is SPECULATORS or (layout is REFERENCE_EAGLE3 and nested is None and top is not None):
        field, given, shift = "eagle_aux_hidden_state_layer_ids", top, -1  # vLLM: id L = input of layer L
    else:
        field, given, shift = "eagle_config.eagle_aux_hidden_state_layer_ids", nested, 0
    if given is None:
        if layout is not REFERENCE_EAGLE3:
            raise HeadImportError(
                f"the head names no target layers ({field} is missing) and the {layout.title} has no default "
                f"to read instead; {engine_guesses(n_layers)}. Each would be a guess: write the ids the head was "
                f"trained on into {field} and load it again"
            )
        ids = [1, n_layers // 2 - 1, n_layers - 4]
        notes.append(f"no layer ids in the config: the reference layout's own layers (outputs {ids})")
        return ids
    if not isinstance(given, list) or not all(isinstance(i, int) for i in given):
        raise HeadImportError(f"{field} must list integer layer ids, got {given!r}")
    ids = [i + shift for i in given]
    if len(set(ids)) != len(ids):
        raise HeadImportError(f"{field} {given} names a layer twice; every engine captures each layer once")
    if min(ids) < 0 or max(ids) > n_layers - 1:
        hint = " (id 0 is the token embedding in vLLM's convention)" if shift and min(given) == 0 else ""
        raise HeadImportError(
            f"{field} {given} lies outside this {n_layers}-layer target's decoder layers{hint}: a head for "
            "another target?"
        )
    if ids != sorted(ids):
        notes.append(f"{field} {given} read in ascending order, as every engine concatenates the states")
    return sorted(ids)


def decoder_shape(config: dict, layout: Engine, notes: list[str]) -> dict:
    """The head's one Llama decoder layer shape as EagleConfig fields, each read from the config."""
    c = config.get("transformer_layer_config") if layout is SPECULATORS else config
    where = "transformer_layer_config." if layout is SPECULATORS else ""
    if not isinstance(c, dict):
        raise HeadImportError("transformer_layer_config is missing: the decoder's shape is not recorded")
    if c.get("model_type", "llama") != "llama":
        raise HeadImportError(
            f"{where}model_type is {c.get('model_type')!r}: draftsmith's head is a Llama decoder layer (a qwen3 "
            "layer also normalizes q and k per head)"
        )
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps"):
        if c.get(key) is None:
            raise HeadImportError(
                f"{where}{key} is missing: the head's decoder cannot be built without guessing it"
            )
    if c.get("hidden_act", "silu") != "silu":
        raise HeadImportError(f"{where}hidden_act is {c['hidden_act']!r}; the head's MLP is SiLU-gated")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise HeadImportError(f"{where}{key} is true; draftsmith's head has no biases")
    rope = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        if layout is MODELOPT and kind == "yarn" and "rope_theta" not in scaling:
            notes.append("rope_scaling (YaRN, added by ModelOpt's export for long-context serving) left out: "
                         "the head was trained with plain RoPE")  # fmt: skip
        else:
            raise HeadImportError(f"{where}rope_scaling is {scaling!r}; draftsmith's head runs plain RoPE")
    theta = c.get("rope_theta") or rope.get("rope_theta")
    if theta is None:
        notes.append("no rope_theta: the Llama default 10000 (what every loader uses)")
    if c.get("num_attention_heads") % (c.get("num_key_value_heads") or c["num_attention_heads"]):
        raise HeadImportError(f"{where}num_key_value_heads must divide num_attention_heads")
    window = c.get("sliding_window") if "sliding_attention" in (c.get("layer_types") or []) else None
    if window:
        notes.append(f"sliding-window attention of {window} positions: draftsmith's head attends to all, "
                     f"the same function for contexts up to {window} tokens")  # fmt: skip
    return {
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "head_dim": c.get("head_dim"),
        "rms_norm_eps": float(c["rms_norm_eps"]),
        "rope_theta": float(theta or 10000.0),
        "max_position_embeddings": c.get("max_position_embeddings") or 4096,
        "num_decoder_layers": c.get("num_hidden_layers") or 1,
    }


def variant_options(config: dict, layout: Engine) -> dict:
    """The head's EAGLE-3 variant (EagleConfig options); a variant draftsmith cannot run is refused by name."""
    if layout is SPECULATORS:
        if config.get("fc_norm"):
            raise HeadImportError("fc_norm is true (one RMSNorm per captured state before fc): draftsmith's head has "
                               "no per-layer norms there; norm_before_fc (one norm over all of them) it has")  # fmt: skip
        return {
            key: bool(config.get(key)) for key in ("norm_before_residual", "norm_before_fc", "norm_output")
        }
    if layout is REFERENCE_EAGLE3:
        if config.get("fc_norm"):
            raise HeadImportError(
                "fc_norm is true (SpecForge's per-layer norms before fc): draftsmith's head has none"
            )
        if config.get("norm_output", True) is False:
            raise HeadImportError("norm_output is false (SpecForge scores the LM head without the final norm): "
                               "draftsmith's head always normalizes before its LM head")  # fmt: skip
        return {}
    eagle = config.get("eagle_config") or {}
    for key, want in (
        ("use_aux_hidden_state", True),
        ("use_last_layernorm", True),
        ("use_mtp_layernorm", False),
    ):
        if key in eagle and bool(eagle[key]) != want:
            raise HeadImportError(f"eagle_config.{key} is {eagle[key]!r}: an EAGLE-3 head has it {want}")
    if (eagle.get("parallel_draft_step") or 1) != 1:
        raise HeadImportError(
            "eagle_config.parallel_draft_step > 1 (parallel draft heads): not an EAGLE-3 chain head"
        )
    return {"feature_input_norm": True}


def vocab_maps(
    tensors: dict[str, torch.Tensor], vocab: int, draft_vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """draftsmith's ``d2t`` (absolute ids) and ``t2d`` (bool) from a layout's offsets; a missing t2d derived."""
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise HeadImportError(f"d2t is missing but the draft vocabulary ({draft_vocab}) is smaller than the "
                               f"target's ({vocab}): which target ids its rows score is not recorded")  # fmt: skip
        return torch.arange(vocab), torch.ones(vocab, dtype=torch.bool)
    offsets = tensors["d2t"].long()
    if offsets.numel() != draft_vocab:
        raise HeadImportError(f"d2t has {offsets.numel()} entries, lm_head {draft_vocab} rows")
    d2t = offsets + torch.arange(draft_vocab)
    if d2t.min() < 0 or d2t.max() >= vocab or d2t.unique().numel() != draft_vocab:
        raise HeadImportError(f"d2t + arange leaves the target vocabulary 0..{vocab - 1} or repeats an id: d2t "
                           "should hold offsets (target id = draft id + d2t[draft id])")  # fmt: skip
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[d2t] = True
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool(), t2d):
        raise HeadImportError("t2d does not mark the target ids d2t maps to")
    return d2t, t2d


def head_state(
    tensors: dict[str, torch.Tensor], layout: Engine, n_layers: int, options: dict
) -> dict[str, torch.Tensor]:
    """The layout's tensors under EagleHead's names; every tensor is used, every needed one found."""
    first = "midlayer." if layout is REFERENCE_EAGLE3 else "layers.0."
    names = {"fc.weight": "fuse_features.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
             first + "input_layernorm.weight": "layers.0.layer.input_layernorm.weight",
             first + "hidden_norm.weight": "layers.0.feature_norm.weight"}  # fmt: skip
    names |= {first + part: "layers.0.layer." + part for part in LAYER_PARTS}
    for i in range(1, n_layers):
        names |= {
            f"layers.{i}.{part}": f"layers.{i}.{part}" for part in [*LAYER_PARTS, "input_layernorm.weight"]
        }
    if options.get("norm_before_fc"):
        names["input_norm.weight"] = "fuse_norm.weight"
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    unknown = sorted(set(tensors) - set(names) - optional)
    missing = sorted(set(names) - set(tensors))
    if unknown or missing:
        raise HeadImportError(f"the {layout.title}'s tensors do not match a {n_layers}-layer head: not mapped "
                           f"{unknown}, missing {missing}")  # fmt: skip
    return {ours: tensors[theirs].float() for theirs, ours in names.items()}


def import_head(target, path: str | Path) -> EagleHead:
    """The head in directory ``path`` (any known layout) as an EagleHead for ``target``, frozen, on its device."""
    path = Path(path)
    config, tensors = read_head_files(path)
    layout = detect_layout(config, tensors)
    notes: list[str] = []
    shape = decoder_shape(config, layout, notes)
    tcfg, V = target.config, target.vocab_size
    what = f"the {layout.title} head in {path}"
    hidden = shape["hidden_size"]
    target_hidden = config.get("target_hidden_size") or hidden
    if target_hidden != tcfg.hidden_size or hidden != tcfg.hidden_size:
        raise HeadImportError(f"{what} reads hidden states of size {target_hidden} (hidden_size {hidden}); the target "
                           f"{target.name!r} has {tcfg.hidden_size}: a head for another target")  # fmt: skip
    layer_config = config.get("transformer_layer_config") or config
    vocab = layer_config.get("vocab_size") or (tensors["t2d"].numel() if "t2d" in tensors else None)
    if vocab != V:
        raise HeadImportError(f"{what} is for a vocabulary of {vocab} tokens; the target {target.name!r} has {V}: "
                           "a head for another target")  # fmt: skip
    if (path / "adapter_config.json").is_file():
        raise HeadImportError(f"{what} comes with a LoRA adapter for its target (adapter_config.json): it was trained "
                           "against the adapted target, which draftsmith does not build")  # fmt: skip
    if config.get("quantization_config"):
        raise HeadImportError(f"{what} is quantized (quantization_config); draftsmith reads float heads")
    options = variant_options(config, layout)
    ids = layer_ids(config, layout, tcfg.num_hidden_layers, notes)
    if "lm_head.weight" not in tensors:
        raise HeadImportError(f"{what} has no lm_head.weight")
    draft_vocab = tensors["lm_head.weight"].shape[0]
    if config.get("draft_vocab_size") not in (None, draft_vocab):
        raise HeadImportError(
            f"draft_vocab_size {config['draft_vocab_size']} but lm_head has {draft_vocab} rows"
        )
    fc = tensors.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (hidden, len(ids) * hidden):
        raise HeadImportError(f"fc.weight has shape {tuple(fc.shape)}, but the head reads {len(ids)} target layers "
                              f"{ids} of size {hidden}: {(hidden, len(ids) * hidden)} expected")  # fmt: skip
    d2t, t2d = vocab_maps(tensors, V, draft_vocab)
    state = head_state(tensors, layout, shape["num_decoder_layers"], options)
    embed = tensors.get("embed_tokens.weight")
    if embed is None:
        notes.append("no token embedding: the target's (as SGLang, vLLM and llama.cpp embed)")
        embed = target.model.get_input_embeddings().weight.detach()
    state["embed_tokens.weight"] = embed.float()
    order = d2t.argsort()  # draftsmith keeps the draft ids in ascending target-id order
    state["lm_head.weight"], state["d2t"], state["t2d"] = state["lm_head.weight"][order], d2t[order], t2d
    record = {
        "layout": layout.name,
        "path": str(path),
        "architectures": config.get("architectures"),
        "notes": notes,
    }
    # an EAGLE-3 head (the config's default preset)
    cfg = EagleConfig(vocab_size=V, draft_vocab_size=draft_vocab, capture_layer_ids=ids,
                      target=target.record(), imported_from=record, **shape, **options)  # fmt: skip
    head = EagleHead(cfg)
    head.load_state_dict({k: v.to(head.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def _build(target, path: str) -> Drafter:
    return EagleDrafter(import_head(target, path), name=f"{PEER_EAGLE3}:{Path(path).name}")


register(DraftKind(PEER_EAGLE3, "EAGLE-3 head from another pipeline", _build, EAGLE, target_key="target",
                   exports=(), refusal="export needs the head read for its target first: pass --target",
                   read_for=import_head))  # fmt: skip
