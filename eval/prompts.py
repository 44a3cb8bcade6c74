"""Evaluation prompt sets: load Spec-Bench / MT-bench JSONL (or ``{"prompt": ...}`` JSONL) and render turns.

Two record shapes are accepted, one JSON object a line:

- Spec-Bench / MT-bench: ``{"question_id", "category", "turns": [user message, ...]}``; a later turn
  continues the conversation after the model's own answer to the previous one.
- plain: ``{"prompt": str}`` with an optional ``"category"`` (``"default"`` when absent).

``--limit N`` keeps the first N prompts in file order (after the ``--categories`` filter). With
``order="round-robin"`` the prompts are taken alternately from each category (in order of first
appearance), so a small limit still samples every category; both orders are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.files import read_jsonl
from draftsmith.sources import HubSource, parse_source

DEFAULT_CATEGORY = "default"
ORDERS = ("file", "round-robin")
ACCEPTED_FIELDS = (
    "'turns' (Spec-Bench/MT-bench: a list of user messages, with 'question_id' and 'category') "
    "or 'prompt' (one user message, optional 'category')"
)


@dataclass(frozen=True)
class EvalPrompt:
    """One question: its id, category and the user turns (one generation per turn)."""

    id: str
    category: str
    turns: tuple[str, ...]


def _parse_record(record: object, where: str, lineno: int) -> EvalPrompt:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got a JSON {type(record).__name__}")
    category = record.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    ident = record.get("question_id", record.get("id"))
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(
                f"{where}: 'turns' must be a non-empty list of non-empty strings, got {turns!r:.80}"
            )
    elif "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {record['prompt']!r:.80}")
        turns = [record["prompt"]]
    else:
        found = ", ".join(repr(k) for k in record) or "none"
        raise ValueError(f"{where}: no usable field; accepted fields are {ACCEPTED_FIELDS} (found: {found})")
    return EvalPrompt(
        id=str(ident) if ident is not None else f"line{lineno}", category=category, turns=tuple(turns)
    )


def read_prompts(path: str | Path) -> list[EvalPrompt]:
    """Every prompt in a JSONL file (or a built-in prompt set, ``builtin:dev_prompts``), in file order;
    blank lines are skipped."""
    spec = path
    path = parse_source(path)
    if isinstance(path, HubSource):
        raise ValueError(
            f"--prompts {spec}: prompts are read from a JSONL file or builtin:dev_prompts, not a dataset; "
            "write the prompts you want to a JSONL file (one object a line with 'turns' or 'prompt')"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt file {path} does not exist (expected a JSONL file, one JSON object a line)"
        )
    prompts = [
        _parse_record(record, f"{path}:{lineno}", lineno)
        for lineno, record in read_jsonl(path, "one JSON object")
    ]
    if not prompts:
        raise ValueError(f"prompt file {path} is empty: it holds no JSON records ({ACCEPTED_FIELDS})")
    return prompts


def round_robin(prompts: Sequence[EvalPrompt]) -> list[EvalPrompt]:
    """Interleave categories (in order of first appearance), keeping file order within each."""
    by_category: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    queues = list(by_category.values())
    out: list[EvalPrompt] = []
    for i in range(max(len(q) for q in queues)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def load_prompts(
    path: str | Path,
    limit: int | None = None,
    categories: Sequence[str] | None = None,
    order: str = "file",
) -> list[EvalPrompt]:
    """Read ``path``, keep ``categories`` (all when None), order them, then keep the first ``limit``."""
    if order not in ORDERS:
        raise ValueError(f"unknown prompt order {order!r}; choose one of {', '.join(ORDERS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    prompts = read_prompts(path)
    if categories:
        present = sorted({p.category for p in prompts})
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise ValueError(
                f"categories {', '.join(unknown)} do not occur in {path}; its categories are: {', '.join(present)}"
            )
        wanted = set(categories)
        prompts = [p for p in prompts if p.category in wanted]
    if order == "round-robin":
        prompts = round_robin(prompts)
    return prompts[:limit] if limit is not None else prompts


def render(tokenizer, conversation: Sequence[dict[str, str]]) -> torch.Tensor:
    """Token ids [S] that ask the model for the next assistant message of ``conversation``.

    With a chat template: the template with ``add_generation_prompt=True``. Without one: the
    messages' plain text joined by blank lines (a single turn is just its text).
    """
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = encoded["input_ids"]
    else:
        ids = tokenizer("\n\n".join(m["content"] for m in conversation))["input_ids"]
    if not ids:
        raise ValueError("a prompt rendered to zero tokens; check the prompt text and the tokenizer")
    return torch.tensor(ids, dtype=torch.long)


def answer_text(tokenizer, tokens: Sequence[int]) -> str:
    """The text of a generated answer, special tokens (EOS, turn markers) dropped, for the next turn."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True).strip()
