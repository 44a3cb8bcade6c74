"""The ``distill`` kind: small causal-LM drafts on the target's tokenizer (DistillSpec-style), and any
other causal LM on that tokenizer used as an independent draft.

Three ways to get one, all returning an ordinary trainable ``PreTrainedModel``:

- ``from_config``: a fresh, randomly initialised model of the target's architecture with fewer or
  narrower layers;
- ``from_target_layers``: embeddings, a chosen subset of decoder layers, final norm and LM head
  copied (not shared) from the target, so training the draft never touches the target;
- ``from_pretrained_draft``: an existing model that shares the target's vocabulary.

``save_draft`` writes a plain transformers directory (``AutoModelForCausalLM`` loads it, it works
as ``assistant_model`` and as ``draftsmith eval --draft DIR``) that records its kind and its target
under ``draftsmith_kind`` / ``draftsmith_target`` in ``config.json``. LoRA adapters come from peft
(``apply_lora``). A draft is used with any target of the same tokenizer (decoding stays lossless), with
a warning when it was distilled for another one.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from draftsmith import files
from draftsmith.decode.features import decoder_layers
from draftsmith.decode.target import Target
from draftsmith.drafts.base import (
    DISTILL,
    DRAFT_FIX,
    DRAFT_KIND_KEY,
    DraftKind,
    Family,
    register,
    strict_load,
)
from draftsmith.drafts.model_drafter import ModelDrafter
from draftsmith.loading import load_causal_lm, tokenizer_fingerprint

TARGET_KEY = "draftsmith_target"


def check_same_vocabulary(target, draft_model, draft_tokenizer, draft_name: str) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    draft_vocab = int(draft_model.get_output_embeddings().weight.shape[0])
    if draft_vocab != target.vocab_size:
        raise ValueError(
            f"draft {draft_name!r} has a vocabulary of {draft_vocab} logits but target {target.name!r} has "
            f"{target.vocab_size}: speculative decoding needs the same tokenizer and vocabulary. "
            "Use a draft from the target's model family, or distill one with `draftsmith train`."
        )
    ours = tokenizer_fingerprint(draft_tokenizer, include_template=False)
    theirs = tokenizer_fingerprint(target.tokenizer, include_template=False)
    if ours != theirs:
        raise ValueError(
            f"draft {draft_name!r} and target {target.name!r} have tokenizers with different vocabularies "
            f"(fingerprints {ours} vs {theirs}): the same id would mean different text. "
            "Use a draft trained on the target's tokenizer."
        )


def warn_if_distilled_for_another_target(target, draft_config, draft_name: str) -> None:
    """A distilled draft records its target; on another one it stays lossless but was not tuned for it."""
    saved = getattr(draft_config, "draftsmith_target", None)
    if not saved:
        return
    current = target.record()
    differs = [
        f for f in ("model_type", "hidden_size", "num_hidden_layers") if saved.get(f) != current.get(f)
    ]
    if differs:
        warnings.warn(
            f"draft {draft_name!r} was distilled for target {saved.get('name')!r}, not {current.get('name')!r} "
            f"({', '.join(f'{f} {saved.get(f)} vs {current.get(f)}' for f in differs)}): decoding stays lossless, "
            "but expect lower acceptance than with a draft distilled for this target",
            stacklevel=2,
        )


def _new_config(target: Target, **changes):
    """A fresh config of the target's (text) architecture class with ``changes`` applied."""
    base = target.config
    values = base.to_dict()
    n = changes.get("num_hidden_layers", base.num_hidden_layers)
    if "layer_types" not in changes and values.get("layer_types") is not None:
        values.pop("layer_types")  # let the config class derive the per-layer pattern for n layers
    values.update(changes)
    config = type(base)(**values)
    if getattr(config, "layer_types", None) is not None and len(config.layer_types) != n:
        raise ValueError(f"{type(base).__name__} built {len(config.layer_types)} layer types for {n} layers")
    return config


def _finish(model: PreTrainedModel, target: Target, dtype: torch.dtype | None) -> PreTrainedModel:
    """Same generation settings as the target, on its device, in ``dtype``, ready to train."""
    if getattr(target.model, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(target.model.generation_config)
    model.to(device=target.device, dtype=dtype or target.dtype)
    return model.train().requires_grad_(True)


def from_config(
    target: Target,
    num_layers: int,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    dtype: torch.dtype | None = torch.float32,
    seed: int | None = None,
    **overrides,
) -> PreTrainedModel:
    """A randomly initialised model of the target's architecture, vocabulary and special tokens.

    Width defaults follow the target: the head size is kept (heads = hidden_size / head_dim), the
    MLP keeps the target's ratio to the hidden size, and the KV heads never exceed the heads.
    ``overrides`` set any other config field (e.g. ``head_dim`` when giving ``num_attention_heads``).
    """
    cfg = target.config
    if num_layers < 1:
        raise ValueError(f"a draft needs at least one layer, got num_layers={num_layers}")
    hidden = hidden_size or cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads = num_attention_heads or (
        cfg.num_attention_heads if hidden == cfg.hidden_size else hidden // head_dim
    )
    if heads < 1 or (num_attention_heads is None and hidden % head_dim):
        raise ValueError(
            f"hidden_size={hidden} is not a multiple of the target's head size {head_dim}: "
            "pass num_attention_heads (and head_dim=...) explicitly"
        )
    kv_heads = num_key_value_heads or min(getattr(cfg, "num_key_value_heads", heads) or heads, heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    changes = dict(num_hidden_layers=num_layers, hidden_size=hidden, num_attention_heads=heads)
    if hasattr(cfg, "num_key_value_heads"):
        changes["num_key_value_heads"] = kv_heads
    if hasattr(cfg, "intermediate_size"):
        changes["intermediate_size"] = intermediate_size or max(
            1, round(cfg.intermediate_size * hidden / cfg.hidden_size)
        )
    changes.update(overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_new_config(target, **changes), dtype=dtype or target.dtype)
    return _finish(model, target, dtype)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def from_target_layers(
    target: Target, layer_ids: Sequence[int], dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """A model made of copies of the target's embeddings, layers ``layer_ids`` (in order), norm and head.

    Negative ids count from the last layer. With every layer, the draft computes the target's logits
    exactly (same dtype); its weights are independent copies either way.
    """
    source_layers = decoder_layers(target.model)
    total = len(source_layers)
    ids = [i + total if i < 0 else i for i in layer_ids]
    if not ids or any(not 0 <= i < total for i in ids):
        raise ValueError(
            f"layer ids {list(layer_ids)} must be a non-empty list within 0..{total - 1} (or negative)"
        )
    changes: dict = {"num_hidden_layers": len(ids)}
    if getattr(target.config, "layer_types", None) is not None:
        changes["layer_types"] = [target.config.layer_types[i] for i in ids]
    draft = AutoModelForCausalLM.from_config(_new_config(target, **changes), dtype=target.dtype)

    source = target.model.state_dict()
    ours = _module_name(draft, decoder_layers(draft)) + "."
    theirs = _module_name(target.model, source_layers) + "."
    weights = {}
    for key in draft.state_dict():
        if key.startswith(ours):
            j, rest = key[len(ours) :].split(".", 1)
            src = f"{theirs}{ids[int(j)]}.{rest}"
        else:
            src = key
        if src not in source:
            raise ValueError(
                f"cannot copy {key!r} from the target: it has no weight {src!r}. from_target_layers needs a plain "
                f"causal LM ({type(target.model).__name__} is laid out differently); use from_config instead."
            )
        weights[key] = source[src].detach().clone()
    draft.load_state_dict(weights, strict=True)
    return _finish(draft, target, dtype)


def from_pretrained_draft(path: str, target: Target, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load an existing causal LM (path or Hub id) as a trainable draft; refuse one with another vocabulary."""
    model, tokenizer, name = load_causal_lm(path, device=target.device, dtype=dtype or target.dtype)
    check_same_vocabulary(target, model, tokenizer, name)
    return _finish(model, target, dtype)


def apply_lora(
    model: PreTrainedModel,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "all-linear",
):
    """Wrap ``model`` in a peft LoRA model: only the adapter weights train ("all-linear" = every linear but the head)."""
    from peft import LoraConfig, get_peft_model

    modules = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    """True for a peft-wrapped model (what ``apply_lora`` returns)."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but a draft without LoRA must not need it
        return False
    return isinstance(model, PeftModel)


def _write(model: nn.Module, tokenizer, target: Target, out: Path, merge: bool) -> None:
    if is_lora(model):
        # work on a copy: merging or unloading in place would break the model being trained
        if merge:
            plain = copy.deepcopy(model).merge_and_unload()
        else:
            plain = copy.deepcopy(model).unload()
            # base weights and adapter in one directory: transformers loads the base from config.json,
            # then applies the adapter it finds next to it (peft's "embedded adapter" layout)
            model.save_pretrained(out)
    else:
        plain = model
    plain.config.update({DRAFT_KIND_KEY: DISTILL, TARGET_KEY: target.record()})
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def save_draft(
    model: nn.Module, tokenizer, target: Target, directory: str | Path, merge: bool = True
) -> Path:
    """Write ``model`` as an ordinary causal-LM directory with the tokenizer and its target's record.

    A LoRA model is either merged into plain weights (``merge=True``) or saved as base weights plus
    a peft adapter in the same directory; both load with ``AutoModelForCausalLM.from_pretrained``.
    The directory appears complete or not at all (written aside, then renamed into place); an
    existing one is replaced.
    """
    return files.replace_dir(directory, lambda tmp: _write(model, tokenizer, target, tmp, merge))


def _build(target, spec: str) -> ModelDrafter:
    model, tokenizer, name = load_causal_lm(spec, device=target.device, dtype=target.dtype)
    check_same_vocabulary(target, model, tokenizer, name)
    warn_if_distilled_for_another_target(target, model.config, name)
    return ModelDrafter(model, name=name)


def verify_saved(folder: Path) -> list[str]:
    """Problems a distilled draft folder has for transformers: weights, a strict ``from_pretrained``, a
    tokenizer within the model's vocabulary and that vocabulary the target's."""
    from transformers import AutoTokenizer

    if not list(folder.glob("*.safetensors")):
        return ["no *.safetensors weights"]
    model, problems = strict_load(AutoModelForCausalLM, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens but the model scores only {vocab}")
    target = files.read_json(folder / "config.json", DRAFT_FIX).get(TARGET_KEY) or {}
    target_vocab = target.get("vocab_size")
    if target_vocab is not None and target_vocab != vocab:
        problems.append(
            f"vocabulary {vocab} differs from the target's {target_vocab}: the engine refuses the pair"
        )
    return problems


def assisted_generation(base_model: str, repo_id: str) -> list[str]:
    """The card's transformers section: the draft as transformers' ``assistant_model``."""
    return [
        "### transformers (assisted generation)",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{base_model}")',
        f'target = AutoModelForCausalLM.from_pretrained("{base_model}")',
        f'draft = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        'inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, '
        'return_tensors="pt", return_dict=True)',
        "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)",
        "```",
        "",
    ]


def card_lines(config: dict) -> list[str]:
    return [
        f"- architecture {config.get('architectures')}, {config.get('num_hidden_layers')} layers, hidden size "
        f"{config.get('hidden_size')}"
    ]


CAUSAL_LM = Family(
    "causal_lm", "causal LM", verify_hf=verify_saved, hf_usage=assisted_generation, card_lines=card_lines,
    library_name="transformers",
)  # fmt: skip
"""An ordinary transformers causal LM: engines load it as a draft model."""
register(DraftKind(DISTILL, "distilled small draft", _build, CAUSAL_LM, target_key=TARGET_KEY))  # all engines
