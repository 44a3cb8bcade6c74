"""Check a GGUF draft against what llama.cpp's loader reads (and transformers', for Llama drafts).

The expectations are written down here from llama.cpp's source (``src/llama-model.cpp``,
``src/models/eagle3.cpp``, ``src/llama-vocab.cpp``; the version in docs/EXPORT.md), not derived from
the writer, so a mistake in ``gguf_export`` shows up as a failed check; llama.cpp itself, run for real,
is the final judge (tests/test_llamacpp.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from draftsmith.loading import read_gguf

HPARAM_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "vocab_size",
)
"""Keys (after the architecture prefix) llama.cpp reads for every decoder."""
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
EAGLE3_KEYS = ("eagle3.target_layers", "eagle3.target_hidden_size")
EAGLE3_ARCH = "eagle3"
"""llama.cpp's architecture name for an EAGLE-3 head (``general.architecture``; llama.cpp's, not a kind)."""
DFLASH_ARCH = "dflash"
"""llama.cpp's architecture name for a DFlash draft (``src/models/dflash.cpp``)."""
DFLASH_KEYS = ("dflash.target_layers", "dflash.block_size", "tokenizer.ggml.mask_token_id")
"""Read by ``llama_model_dflash`` (target_layers: required) and ``common_speculative_impl_draft_dflash``
(block_size: 16 when missing; the mask token: ``llama_vocab_mask``, none without it)."""


def _layer_shapes(i: int, H: int, heads: int, kv_heads: int, hd: int, ff: int, attn_in: int) -> dict:
    return {
        f"blk.{i}.attn_norm.weight": (H,),
        f"blk.{i}.ffn_norm.weight": (H,),
        f"blk.{i}.attn_q.weight": (heads * hd, attn_in),
        f"blk.{i}.attn_k.weight": (kv_heads * hd, attn_in),
        f"blk.{i}.attn_v.weight": (kv_heads * hd, attn_in),
        f"blk.{i}.attn_output.weight": (H, heads * hd),
        f"blk.{i}.ffn_gate.weight": (ff, H),
        f"blk.{i}.ffn_up.weight": (ff, H),
        f"blk.{i}.ffn_down.weight": (H, ff),
    }


def verify_gguf(path: Path) -> list[str]:
    """Problems a GGUF draft has for llama.cpp (and transformers, for Llama drafts): metadata the loader
    needs, the exact tensor set and shapes; for an ``eagle3`` head also its layer ids and ``d2t``."""
    found = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if len(found) != 1:
        return [f"expected one .gguf file at {path}, found {len(found)}"]
    reader = read_gguf(found[0], "Export it again")  # a cut-short file: one line naming it
    fields = reader.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    if arch not in ("llama", EAGLE3_ARCH, DFLASH_ARCH):
        return [
            f"general.architecture must be 'llama' (a draft model), 'eagle3' (an EAGLE-3 head) or 'dflash' (a "
            f"DFlash draft), got {arch!r}"
        ]
    required = [f"{arch}.{k}" for k in HPARAM_KEYS] + list(TOKENIZER_KEYS)
    required += {EAGLE3_ARCH: list(EAGLE3_KEYS), DFLASH_ARCH: list(DFLASH_KEYS)}.get(arch, [])
    problems = [f"metadata {k} missing (the loader would guess it)" for k in required if k not in fields]
    if problems:
        return problems
    meta = {
        k.removeprefix(f"{arch}."): fields[k].contents() for k in required if k != "tokenizer.ggml.tokens"
    }
    n_tokens = len(fields["tokenizer.ggml.tokens"].data)
    if meta["tokenizer.ggml.model"] == "gpt2" and "tokenizer.ggml.merges" not in fields:
        problems.append("a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges")
    if meta["tokenizer.ggml.model"] == "gpt2" and fields.get("tokenizer.ggml.pre") is None:
        problems.append("tokenizer.ggml.pre missing: llama.cpp would split text with its default regex")
    if "general.name" in fields and "mistral" in str(fields["general.name"].contents()).lower():
        problems.append(
            "general.name contains 'mistral': transformers would load the file as a Mistral model"
        )
    H, L, V = meta["embedding_length"], meta["block_count"], meta["vocab_size"]
    heads, kv_heads = meta["attention.head_count"], meta["attention.head_count_kv"]
    hd, ff = meta["rope.dimension_count"], meta["feed_forward_length"]
    if n_tokens != V:
        problems.append(f"{n_tokens} tokens but {arch}.vocab_size {V}")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    if arch == "llama":
        expected = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
        for i in range(L):
            expected |= _layer_shapes(i, H, heads, kv_heads, hd, ff, H)
        if "output.weight" in shapes:
            expected["output.weight"] = (V, H)
    elif arch == DFLASH_ARCH:
        problems += _check_dflash_meta(reader, meta)
        d2t = next((t for t in reader.tensors if t.name == "d2t"), None)
        taps = len(reader.fields["dflash.target_layers"].contents())
        expected = {"fc.weight": (H, taps * H), "enc.output_norm.weight": (H,), "output_norm.weight": (H,)}
        for i in range(L):
            expected |= _layer_shapes(i, H, heads, kv_heads, hd, ff, H)
            expected |= {f"blk.{i}.attn_q_norm.weight": (hd,), f"blk.{i}.attn_k_norm.weight": (hd,)}
        if d2t is not None:  # the graph scatters the draft's own head's logits through d2t
            expected |= {"d2t": (int(d2t.shape[0]),), "output.weight": (int(d2t.shape[0]), H)}
            problems += _check_d2t(d2t, V)
        elif "output.weight" in shapes:
            expected["output.weight"] = (V, H)
        if "token_embd.weight" in shapes:
            expected["token_embd.weight"] = (V, H)
        if "markov_w1.weight" in shapes:  # DSpark: the Markov head, [V, r] by target ids and [Vd, r]
            rank = shapes["markov_w1.weight"][1]
            expected |= {
                "markov_w1.weight": (V, rank),
                "markov_w2.weight": (expected.get("d2t", (V,))[0], rank),
            }
            anchor = fields.get("dflash.sample_from_anchor")
            if anchor is None or bool(anchor.contents()):
                problems.append(
                    "dflash.sample_from_anchor is not false: llama.cpp would bias and draft slot 0, which holds "
                    "the last token in draftsmith's blocks"
                )
    else:
        problems += _check_eagle3_meta(reader, meta, L)
        d2t = next((t for t in reader.tensors if t.name == "d2t"), None)
        Vd = int(d2t.shape[0]) if d2t is not None else V
        expected = {
            "fc.weight": (H, 3 * meta["target_hidden_size"]),
            "output_norm.weight": (H,),
            "output.weight": (Vd, H),
            "blk.0.attn_norm_2.weight": (H,),
            **_layer_shapes(0, H, heads, kv_heads, hd, ff, 2 * H),
        }
        if d2t is not None:
            expected["d2t"] = (Vd,)
            problems += _check_d2t(d2t, V)
        if "eagle3.norm_before_fc" in fields and fields["eagle3.norm_before_fc"].contents():
            expected["enc.output_norm.weight"] = (3 * meta["target_hidden_size"],)
        if "token_embd.weight" in shapes:
            expected["token_embd.weight"] = (V, H)
    problems += [f"tensor {n} missing" for n in sorted(set(expected) - set(shapes))]
    problems += [
        f"tensor {n} is not one the loader maps (it would be skipped)"
        for n in sorted(set(shapes) - set(expected))
    ]
    problems += [
        f"tensor {n} has shape {shapes[n]}, expected {expected[n]}"
        for n in sorted(set(expected) & set(shapes))
        if shapes[n] != expected[n]
    ]
    return problems


def _check_eagle3_meta(reader: gguf.GGUFReader, meta: dict, n_layers: int) -> list[str]:
    """llama.cpp's eagle3 loader: one block, exactly 3 target layers (ascending, as fc's columns are)."""
    problems = (
        [] if n_layers == 1 else [f"eagle3.block_count is {n_layers}; llama.cpp's eagle3 graph has one block"]
    )
    ids = [int(i) for i in reader.fields["eagle3.target_layers"].contents()]
    if len(ids) != 3:
        problems.append(f"eagle3.target_layers must list exactly 3 layer ids, got {ids}")
    elif ids != sorted(set(ids)):
        problems.append(
            f"eagle3.target_layers {ids} must be distinct and ascending (fc's columns follow that order)"
        )
    return problems


def _check_dflash_meta(reader: gguf.GGUFReader, meta: dict) -> list[str]:
    """llama.cpp's DFlash drafter: ascending target layers >= 1 (the input of layer L; 0 is the embedding
    no target extracts), a block of the last token and at least one slot, a mask token of the vocabulary."""
    problems = []
    ids = [int(i) for i in reader.fields["dflash.target_layers"].contents()]
    if not ids or ids != sorted(set(ids)) or ids[0] < 1:
        problems.append(
            f"dflash.target_layers {ids} must be distinct, ascending and >= 1 (fc's columns follow that order)"
        )
    block = int(meta["block_size"])
    if block < 2:
        problems.append(f"dflash.block_size {block}: a block holds the last token and at least one to draft")
    mask = int(meta["tokenizer.ggml.mask_token_id"])
    if not 0 <= mask < int(meta["vocab_size"]):
        problems.append(f"tokenizer.ggml.mask_token_id {mask} is not a token of the vocabulary")
    return problems


def _check_d2t(d2t, vocab: int) -> list[str]:
    if d2t.tensor_type != gguf.GGMLQuantizationType.I64:
        return [f"d2t must be I64 (llama.cpp asserts it), got {d2t.tensor_type.name}"]
    ids = np.asarray(d2t.data).reshape(-1)
    if ids.min() < 0 or ids.max() >= vocab:
        return [f"d2t holds ids outside the target vocabulary 0..{vocab - 1} (llama.cpp reads absolute ids)"]
    if np.unique(ids).size != ids.size:
        return ["d2t maps two draft ids to one target id"]
    return []


def verify(path: Path) -> tuple[str, list[str]]:
    """The ``gguf`` engine's verifier (registered by ``gguf.py``)."""
    return "GGUF file", verify_gguf(path)
