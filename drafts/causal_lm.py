"""An independent draft: any causal LM that shares the target's tokenizer, with its own KV cache."""

from __future__ import annotations

import warnings

from draftsmith.decode.drafter import Drafter
from draftsmith.drafts.base import register
from draftsmith.drafts.model_drafter import ModelDrafter
from draftsmith.loading import load_causal_lm, tokenizer_fingerprint


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


@register("causal_lm")
def _build(target, spec: str) -> Drafter:
    model, tokenizer, name = load_causal_lm(spec, device=target.device, dtype=target.dtype)
    check_same_vocabulary(target, model, tokenizer, name)
    warn_if_distilled_for_another_target(target, model.config, name)
    return ModelDrafter(model, name=name)
