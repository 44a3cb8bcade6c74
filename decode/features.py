"""Capture hidden states of chosen decoder layers from a stock transformers model.

Convention, used everywhere in draftsmith and recorded in every draft config as
``layer_id_convention = "output-of-layer-0-based"``: layer id ``i`` is the output of decoder
layer ``i`` (0-based), before any final norm. It equals ``hidden_states[i + 1]`` of
``output_hidden_states=True`` except for the last layer, whose entry there is post-norm in most
architectures (Llama, Qwen, Mistral). Negative ids (-1 = last layer) are resolved to non-negative
integers before they are stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

LAYER_ID_CONVENTION = "output-of-layer-0-based"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of a causal LM (``model.model.layers`` for most architectures)."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if config is not None else None
    n_layers = getattr(text_config, "num_hidden_layers", None)
    for path in (
        "model.layers",
        "model.decoder.layers",
        "transformer.h",
        "gpt_neox.layers",
        "model.language_model.layers",
    ):
        module: nn.Module | None = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList) and (n_layers is None or len(module) == n_layers):
            return module
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: expected one nn.ModuleList of "
        f"{n_layers} layers (e.g. model.model.layers). Open an issue with the model class name."
    )


def resolve_layer_ids(model: nn.Module, layer_ids: list[int]) -> list[int]:
    """Turn negative ids (-1 = last layer) into 0-based ids and check they exist."""
    n = len(decoder_layers(model))
    resolved = []
    for i in layer_ids:
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise ValueError(
                f"layer id {i} is out of range for a target with {n} decoder layers (valid: 0..{n - 1})"
            )
        resolved.append(j)
    return resolved


@contextmanager
def capture_layers(model: nn.Module, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks that store the output of each chosen decoder layer into the yielded dict.

    The dict is filled anew by every forward inside the ``with`` block: ``{layer_id: [B, S, H]}``.
    """
    layers = decoder_layers(model)
    store: dict[int, torch.Tensor] = {}
    handles = []
    for layer_id in resolve_layer_ids(model, layer_ids):

        def hook(_module, _inputs, output, layer_id=layer_id):
            store[layer_id] = output[0] if isinstance(output, tuple) else output

        handles.append(layers[layer_id].register_forward_hook(hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def final_norm(model: nn.Module) -> nn.Module:
    """The norm a causal LM applies after its last decoder layer, before the LM head (``model.norm`` in
    most architectures): with the LM head, it reads a middle layer's output as next-token logits (the
    logit lens, which Mirror decoding's early exit uses)."""
    base = getattr(model, "base_model", model)
    for owner in (base, getattr(base, "language_model", None), getattr(base, "decoder", None)):
        for name in ("norm", "final_layernorm", "ln_f", "norm_f", "final_norm"):
            module = getattr(owner, name, None) if owner is not None else None
            if isinstance(module, nn.Module):
                return module
    raise ValueError(
        f"cannot find the final norm of {type(model).__name__} (looked for norm, final_layernorm, ln_f on "
        "its base model), so its layers cannot be read as next-token logits. Open an issue with the model "
        "class name."
    )
