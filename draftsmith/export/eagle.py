"""EAGLE-3 heads in the layout vLLM's and SGLang's EAGLE-3 loaders read (see docs/EXPORT.md).

A family that extends the layout passes the config fields it adds (``fields``: a function of the head's
config.json); a head's optional tensors (``OPTIONAL_WEIGHTS``) are carried where its config sets their field,
those over the concatenated target states (``mask_hidden`` [1, 1, 3·H] of a head that drafts in parallel, vLLM's
``input_norm``) with their blocks in ascending layer order, as fc's columns.

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
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith import files
from draftsmith.decode.features import LAYER_ID_CONVENTION
from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.eagle import is_eagle3
from draftsmith.drafts.engines import GGUF, SGLANG, SPECULATORS, VLLM, engine_named
from draftsmith.drafts.taps import refuse_uncaptured_last_layer

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
    "mask_hidden": "mask_hidden",  # heads that draft in parallel only
    "fuse_norm.weight": "input_norm.weight",  # norm_before_fc heads only (vLLM's name)
}
OPTIONAL_WEIGHTS = {"mask_hidden": "mask_token_id", "fuse_norm.weight": "norm_before_fc"}
"""Weights a head has only with this config field set."""


LAYER_ID_SHIFT = {VLLM.name: 1, SPECULATORS.name: 1, GGUF.name: 1, SGLANG.name: 0}
"""draftsmith id i ("output of layer i") is written as i + shift: vLLM (and speculators checkpoints, which
vLLM reads), and llama.cpp's ``extract_layers``, count the *input* of layer L; SGLang adds 1 itself."""
VARIANT_FIELDS = ("norm_before_residual", "norm_before_fc", "norm_output", "feature_input_norm")
"""EagleConfig options of heads from other pipelines (drafts/eagle_import.py)."""
EAGLE31_NORMS = ("norm_before_residual", "norm_before_fc", "norm_output")
"""The EAGLE-3.1 norms draftsmith trains (``draft.options``)."""
VARIANTS_CARRIED = {GGUF.name: ("norm_before_residual", "norm_before_fc"), VLLM.name: EAGLE31_NORMS}
"""The variants an engine's layout carries: llama.cpp's eagle3 graph reads ``eagle3.norm_before_residual``
and ``eagle3.norm_before_fc`` (with ``enc.output_norm.weight``); vLLM 0.32's llama_eagle3.py reads the three
EAGLE-3.1 flags from config.json (``norm_before_fc`` with the weight ``input_norm.weight``, one RMSNorm over the
concatenated states; ``norm_output``: the post-norm state fed back). The others are refused by name."""


class VariantNotExpressed(ValueError):
    """A peer's head uses an EAGLE-3 variant the engine layout draftsmith writes does not carry: the head is
    fine, and the pipeline that trained it may export it for that engine itself."""


VARIANT_REASONS = {
    "norm_output": "llama.cpp feeds the pre-norm state back to the next draft step, this head the normed one",
    "feature_input_norm": "llama.cpp norms the fused feature with hidden_norm alone, this head with "
    "input_layernorm first",
}


def engine_layer_ids(layer_ids: list[int], engine: str) -> list[int]:
    """draftsmith ids ("output of layer i, 0-based") → the ids ``engine`` expects in its config."""
    if engine not in LAYER_ID_SHIFT:
        raise ValueError(f"no EAGLE-3 layer-id convention for engine {engine!r}")
    return [i + LAYER_ID_SHIFT[engine] for i in layer_ids]


def drops_vocab_map(config: dict, engine: str) -> bool:
    """True where the engine must get no ``d2t``: vLLM creates its draft→target map only when the draft
    vocabulary is smaller than the target's, and its loader raises on a ``d2t`` it has no parameter
    for; llama.cpp treats a missing ``d2t`` as "the target's vocabulary". SGLang reads an identity map."""
    return engine != SGLANG.name and config["draft_vocab_size"] == config["vocab_size"]


def check_exportable(config: dict, engine: str) -> None:
    """Refuse heads the engine's EAGLE-3 loader cannot represent, with the reason."""
    name = engine_named(engine).title
    if not is_eagle3(config):
        raise ValueError(
            f"only EAGLE-3 heads export to {engine}; this head is preset {config.get('preset')!r} (draftsmith's "
            "EAGLE-1 head keeps the first layer's input norm and reads the target's norm, which the engines' "
            "EAGLE-1 loaders do not). Train an eagle3 head, or use it with `draftsmith eval`."
        )
    if config.get("num_decoder_layers", 1) != 1:
        raise ValueError(
            f"the head has {config['num_decoder_layers']} decoder layers; the {name} EAGLE-3 layout exported "
            "here has exactly one (midlayer). Train with draft.options.num_decoder_layers: 1."
        )
    ids = list(config.get("capture_layer_ids") or [])
    if len(ids) != 3:
        raise ValueError(
            f"{name}'s EAGLE-3 loader fuses exactly 3 target layers (fc reads 3 x target_hidden_size); this "
            f"head reads {len(ids)}: {ids}"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"the head reads target layers {ids}, one of them twice; {name} captures each layer once, so its "
            "fc would get fewer states than it was trained on. Train the head on three distinct layers."
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
    if min(ids) < 0 or max(ids) > n_layers - 1:
        raise ValueError(f"layer ids {ids} lie outside the target's {n_layers} layers (0..{n_layers - 1})")
    refuse_uncaptured_last_layer(ids, n_layers, engine_named(engine))
    if config.get("lm_head_is_embedding") or config.get("logit_softcap"):
        raise ValueError("EAGLE-3 heads exported to engines need their own LM head and no logit softcap")
    carried = VARIANTS_CARRIED.get(engine, ())
    variants = [key for key in VARIANT_FIELDS if config.get(key) and key not in carried]
    if variants:
        reasons = (
            VARIANT_REASONS if engine == GGUF.name else {}
        )  # llama.cpp's graph, read; the others carry none
        why = "".join(f"; {key}: {reasons[key]}" for key in variants if key in reasons)
        raise VariantNotExpressed(
            f"the head uses {', '.join(variants)}: variants of EAGLE-3 the {name} layout draftsmith writes does "
            f"not express (it would run another function{why}). Export it to vllm, which carries the EAGLE-3.1 "
            "norms, evaluate it with `draftsmith eval`, or (a peer's head) export it with the pipeline that trained "
            "it."
        )


def ascending_capture(layer_ids: list[int], fc: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The layer ids in ascending order and ``fc`` [H, n·H_t] with its column blocks permuted to match.

    The head concatenates the captured states in ``capture_layer_ids`` order; every engine concatenates
    them in ascending layer order. Permuting fc's input blocks the same way gives the same product.
    """
    order = sorted(range(len(layer_ids)), key=layer_ids.__getitem__)
    blocks = fc.split(fc.shape[1] // len(layer_ids), dim=1)
    return [layer_ids[j] for j in order], torch.cat([blocks[j] for j in order], dim=1).contiguous()


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


def reference_weights(weights: dict[str, torch.Tensor], config: dict, engine: str) -> dict[str, torch.Tensor]:
    """draftsmith EagleHead tensors → reference EAGLE-3 tensors for ``engine``: names mapped, fc's
    columns in ascending layer order, ``d2t`` as offsets (or left out where the engine wants none)."""
    unknown = sorted(set(weights) - set(NAME_MAP))
    optional = {name for name, field in OPTIONAL_WEIGHTS.items() if not config.get(field)}
    missing = sorted(set(NAME_MAP) - set(weights) - optional)
    if unknown or missing:
        raise ValueError(
            f"the EAGLE head's weights do not match the one-layer EAGLE-3 layout: unknown {unknown}, missing {missing}"
        )
    out = {NAME_MAP[name]: tensor.contiguous() for name, tensor in weights.items()}
    _, out["fc.weight"] = ascending_capture(config["capture_layer_ids"], out["fc.weight"])
    if (
        "mask_hidden" in out
    ):  # concatenated target states, like fc's input: blocks in the same order, [1, 1, n·H]
        _, mask = ascending_capture(config["capture_layer_ids"], out["mask_hidden"][None])
        out["mask_hidden"] = mask.view(1, 1, -1)
    if "input_norm.weight" in out:  # an RMSNorm over fc's input: its blocks in fc's order
        _, norm = ascending_capture(config["capture_layer_ids"], out["input_norm.weight"][None])
        out["input_norm.weight"] = norm[0]
    d2t = weights["d2t"].long()
    if drops_vocab_map(config, engine):
        if not torch.equal(d2t, torch.arange(d2t.numel())):
            raise ValueError(
                "a full draft vocabulary must map draft id i to target id i; the head's d2t does not"
            )
        del out["d2t"], out["t2d"]
        return out
    out["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()  # absolute ids -> offsets
    out["t2d"] = weights["t2d"].bool().contiguous()
    return out


def layer_names(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference EAGLE-3 tensors (``midlayer.*``) under the decoder-list names speculators and SpecForge's parallel-drafting
    class use (``layers.0.*``)."""
    return {
        ("layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name): tensor
        for name, tensor in reference.items()
    }


def decoder_fields(config: dict) -> dict:
    """The head's one Llama decoder layer as the engines' config readers want it (no default left to guess)."""
    return {
        "model_type": "llama",
        "hidden_size": config["hidden_size"],
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
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def reference_config(config: dict, engine: str, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """The config.json the engine's EAGLE-3 loader reads, with the ``extra`` fields a family adds to the layout
    and draftsmith's own record alongside."""
    out = {
        "architectures": [ARCHITECTURE],
        **decoder_fields(config),
        "target_hidden_size": config["target"]["hidden_size"],
        "draft_vocab_size": config["draft_vocab_size"],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    ids = engine_layer_ids(sorted(config["capture_layer_ids"]), engine)
    out |= extra or {}
    if engine == VLLM.name:
        out["eagle_aux_hidden_state_layer_ids"] = ids
        # norm_before_residual written even when false (vLLM once read a missing one as true); the others when
        # set (a missing one is false in vLLM, and a written norm_output false means SpecForge's unnormed read-out)
        out["norm_before_residual"] = bool(config.get("norm_before_residual"))
        out |= {key: True for key in ("norm_before_fc", "norm_output") if config.get(key)}
    else:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    out[SOURCE_KEY] = source_record(config, engine)
    return out


def source_record(config: dict, engine: str) -> dict:
    """What the export was made from (loaders ignore it; the verifier reads it)."""
    trained = list(config["capture_layer_ids"])
    record = {
        "engine": engine,
        "capture_layer_ids": sorted(trained),
        "layer_id_convention": config["layer_id_convention"],
        "d2t": "none (full vocabulary)"
        if drops_vocab_map(config, engine)
        else "offsets (target id = draft id + d2t[draft id])",
        "target": config["target"],
    }
    if config.get("parallel_depths"):
        record["parallel_depths"] = config["parallel_depths"]
    if any(config.get(key) for key in EAGLE31_NORMS):
        record["norms"] = {key: bool(config.get(key)) for key in EAGLE31_NORMS}
    if trained != sorted(trained):
        record["trained_capture_layer_ids"] = trained
        record["fc"] = "column blocks permuted into ascending layer order"
    return record


def write_folder(out: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """An engine's EAGLE-3 folder: its config.json and one model.safetensors, replacing an earlier export at ``out``
    (the user's other files there are kept)."""

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return files.replace_dir(out, fill, keep_others=True)


def export_eagle(
    ckpt: DraftCheckpoint, out: Path, engine: str, fields: Callable[[dict], dict] | None = None
) -> Path:
    """Write ``ckpt`` (an EAGLE head) as the folder ``out`` in the reference layout for ``engine`` (vllm, sglang),
    with the config fields a family that extends the layout adds (``fields`` of the head's config)."""
    if not isinstance(ckpt.config.get("capture_layer_ids"), list) or "num_decoder_layers" not in ckpt.config:
        raise ValueError(f"{ckpt.draft_dir} is a {ckpt.kind.title}, not an EAGLE head")
    check_exportable(ckpt.config, engine)
    weights = reference_weights(read_weights(ckpt.draft_dir), ckpt.config, engine)
    extra = fields(ckpt.config) if fields else None
    return write_folder(
        out, reference_config(ckpt.config, engine, weights["fc.weight"].dtype, extra), weights
    )
