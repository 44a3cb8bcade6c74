"""The tokenizer a GGUF draft carries, as llama.cpp's ``tokenizer.*`` metadata (``draftsmith/export/gguf.py``).

Copied from a GGUF of the target after checking it spells the draft's vocabulary, or written from the
draft's byte-level BPE tokenizer under the llama.cpp pre-tokenizer name that splits text the same way.
A helper of the ``gguf`` engine's module, not an engine of its own (no record names it).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from draftsmith.loading import read_gguf

TARGET_GGUF_FIX = "Pass a whole GGUF of the draft's target with --target-gguf (download or convert it again)"


def source_tokenizer_fields(source: Path, tokens: list[str]) -> list[tuple]:
    """tokenizer.* metadata of ``source`` (a GGUF of the target), after checking it spells ``tokens``."""
    reader = read_gguf(source, TARGET_GGUF_FIX)
    field = reader.fields.get("tokenizer.ggml.tokens")
    theirs = list(field.contents()) if field is not None else []
    if theirs[: len(tokens)] != tokens or len(theirs) != len(tokens):
        raise ValueError(
            f"{source} has another vocabulary than the draft's tokenizer ({len(theirs)} vs {len(tokens)} tokens, or "
            "spelled differently); pass the GGUF of the draft's own target with --tokenizer-gguf"
        )
    return fields_with_prefix(reader, "tokenizer.")


def fields_with_prefix(reader: gguf.GGUFReader, prefix: str) -> list[tuple]:
    """(key, value, type, array element type) of every metadata field whose key starts with ``prefix``."""
    fields = []
    for key, f in reader.fields.items():
        if key.startswith(prefix):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, f.contents(), f.types[0], sub))
    return fields


GPT2_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
PRE_TOKENIZERS = {
    "gpt-2": [GPT2_BYTE_LEVEL],
    "smollm": [{"type": "Digits", "individual_digits": True}, GPT2_BYTE_LEVEL],
}
"""llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``, src/llama-vocab.cpp) for the Hugging Face
pre-tokenizers they reproduce: GPT-2's split regex, and SmolLM's single digits before it."""


def pre_tokenizer_name(pre: dict | None) -> str:
    """The llama.cpp pre-tokenizer that splits text as the Hugging Face ``pre`` does; refuse the rest.

    llama.cpp's ``default`` is not GPT-2's regex (it splits punctuation and digits apart), so naming the
    wrong one silently changes how every prompt is tokenized.
    """
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre or {}]
    for name, expected in PRE_TOKENIZERS.items():
        if len(steps) == len(expected) and all(
            all(step.get(k, True if k == "use_regex" else None) == v for k, v in want.items())
            for step, want in zip(steps, expected)
        ):
            return name
    raise ValueError(
        f"the draft's tokenizer splits text with {json.dumps(pre)}, which this writer cannot name for llama.cpp "
        f"(it writes {', '.join(PRE_TOKENIZERS)}); pass --target-gguf with a GGUF of the target (llama.cpp's "
        "convert_hf_to_gguf.py knows many more tokenizers) to copy its tokenizer instead"
    )


def token_types(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token strings and llama.cpp token types: CONTROL for special tokens (added ones included, e.g.
    ``<|im_start|>``: llama.cpp drops them when detokenizing), USER_DEFINED for other added tokens."""
    id_to_token = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    special = set(tokenizer.all_special_ids) | {i for i, tok in added.items() if tok.special}
    tokens, types = [], []
    for i in range(vocab_size):
        token = id_to_token.get(i)
        if token is None:  # the model scores more ids than the tokenizer has: padding rows
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in special:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    return tokens, types


def tokenizer_from_hf(writer: gguf.GGUFWriter, tokenizer, vocab_size: int) -> None:
    """Write a byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``) from the draft's tokenizer files."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(backend.get("pre_tokenizer")):
        raise ValueError(
            "GGUF export writes byte-level BPE tokenizers (GPT-2 style) only; pass --target-gguf with a GGUF of "
            "the target to copy its tokenizer instead"
        )
    pre = pre_tokenizer_name(backend.get("pre_tokenizer"))
    tokens, types = token_types(tokenizer, vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:
        raise ValueError(
            "the draft's BPE tokenizer has no merges, and llama.cpp refuses a gpt2 tokenizer without them; pass "
            "--target-gguf with a GGUF of the target"
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("unk_token_id", writer.add_unk_token_id),
        ("pad_token_id", writer.add_pad_token_id),
    ):
        if getattr(tokenizer, name, None) is not None:
            add(getattr(tokenizer, name))
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)
