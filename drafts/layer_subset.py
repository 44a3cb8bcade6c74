"""``layers:N`` — self-speculative drafting with the target's own first N layers.

The draft is the target's embeddings, its first N decoder layers, its final norm and LM head:
no training, no extra weights (modules are shared, not copied), its own KV cache.
"""

from __future__ import annotations

import copy

from torch import nn

from draftsmith.decode.drafter import Drafter
from draftsmith.decode.features import decoder_layers
from draftsmith.drafts.base import LAYERS, TRAINING_FREE, DraftKind, register
from draftsmith.drafts.model_drafter import ModelDrafter


def truncated_config(config, n: int):
    """A copy of a (text) config with only the first n layers."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:n]
    return cfg


def layer_subset_view(model: nn.Module, n: int) -> nn.Module:
    """A shallow copy of ``model`` whose decoder runs only layers[:n]; every weight is shared."""
    layers = decoder_layers(model)
    total = len(layers)
    if not 1 <= n <= total:
        raise ValueError(f"layers:{n} asked for, but the target has {total} decoder layers (use 1..{total})")
    path = next(name for name, module in model.named_modules() if module is layers).split(".")
    cfg = truncated_config(model.config, n)
    root = copy.copy(model)  # shallow: shares parameters and buffers
    root._modules = dict(model._modules)
    root.config = cfg
    parent = root
    for part in path[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        if hasattr(child, "config"):
            child.config = cfg
        parent._modules[part] = child
        parent = child
    parent._modules[path[-1]] = nn.ModuleList(list(layers)[:n])
    return root


def _build(target, arg: str) -> Drafter:
    if not arg.isdigit():
        raise ValueError(f"layer-subset draft needs a layer count, e.g. 'layers:8' (got 'layers:{arg}')")
    n = int(arg)
    view = layer_subset_view(target.model, n)
    return ModelDrafter(view, name=f"layers:{n}")


register(DraftKind(LAYERS, "layer-subset drafter", _build, TRAINING_FREE,
                   refusal="it has no weights of its own (it is the target's first N layers, final norm and LM head); an "
                   "engine serves it as a small draft model: save the target with only its first N layers "
                   "(transformers, num_hidden_layers=N) and serve that (vLLM: method draft_model)"))  # fmt: skip
