"""The ``hf`` engine's work: draftsmith's own transformers layout, the draft directory as it is.

Every kind with a checkpoint goes there; a distilled draft loads as transformers' ``assistant_model``,
an EAGLE head or Medusa heads as a ``PreTrainedModel`` that draftsmith's decoder runs.
"""

from __future__ import annotations

from draftsmith.drafts.engines import HF
from draftsmith.export import copy_export
from draftsmith.export.engines import CardContext
from draftsmith.export.verify import verify_hf


def usage(card: CardContext) -> list[str]:
    """transformers' assisted generation for a causal LM; draftsmith's decoder for the heads."""
    base, repo = card.base_model, card.repo_id
    if card.kind.family == "causal_lm":
        return [
            "### transformers (assisted generation)",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'tokenizer = AutoTokenizer.from_pretrained("{base}")',
            f'target = AutoModelForCausalLM.from_pretrained("{base}")',
            f'draft = AutoModelForCausalLM.from_pretrained("{repo}")',
            'inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, '
            'return_tensors="pt", return_dict=True)',
            "out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)",
            "```",
            "",
        ]
    return [
        "### transformers",
        "",
        f"transformers has no assistant of this kind; the {card.kind.title} is a `PreTrainedModel` that draftsmith's "
        "decoder runs:",
        "",
        "```python",
        "from draftsmith.decode.speculative import generate",
        "from draftsmith.decode.target import load_target",
        "from draftsmith.drafts import build_drafter",
        "from draftsmith.eval.prompts import render",
        "",
        f'target = load_target("{base}")',
        f'drafter = build_drafter("{repo}", target)',
        'prompt = render(target.tokenizer, [{"role": "user", "content": "Hi!"}])',
        f"out = generate(target, prompt, drafter, k={card.k}, max_new_tokens=128)  # greedy: the target's own tokens",
        "print(target.tokenizer.decode(out.tokens))",
        "```",
        "",
    ]


HF.writers.update(dict.fromkeys(("eagle", "causal_lm", "medusa"), copy_export))
HF.verify, HF.usage = verify_hf, usage
