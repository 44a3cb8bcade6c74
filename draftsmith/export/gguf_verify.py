"""Check a GGUF draft against what llama.cpp's loader reads (and transformers', for Llama drafts).

The expectations are written down here from llama.cpp's source (``src/llama-model.cpp``,
``src/models/eagle3.cpp``, ``src/llama-vocab.cpp``; the version in docs/EXPORT.md), not derived from
the writer, so a mistake in ``gguf_export`` shows up as a failed check; llama.cpp itself, run for real,
is the final judge (tests/test_llamacpp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Decoder:
    """What a GGUF's metadata says of its decoder, for an architecture's check of its tensors."""

    reader: gguf.GGUFReader
    meta: dict
    """The required keys' values, the architecture prefix removed."""
    shapes: dict[str, tuple[int, ...]]
    """Every tensor's shape in PyTorch's order."""
    H: int
    L: int
    V: int
    heads: int
    kv_heads: int
    hd: int
    ff: int


@dataclass(frozen=True)
class DraftArchitecture:
    """A llama.cpp draft architecture draftsmith writes besides ``llama``: the metadata keys its loader needs
    beyond every decoder's, and ``expected(decoder) -> (tensor name -> shape, problems)``."""

    name: str
    """``general.architecture``."""
    title: str
    """What the refusal of an unknown architecture calls it ("an EAGLE-3 head")."""
    keys: tuple[str, ...]
    expected: Callable[[Decoder], tuple[dict[str, tuple], list[str]]]


_ARCHITECTURES: dict[str, DraftArchitecture] = {}


def register_architecture(arch: DraftArchitecture) -> DraftArchitecture:
    """Make a draft architecture known to ``verify_gguf`` (its writer's module calls this at import); one record
    per name."""
    if _ARCHITECTURES.get(arch.name, arch) is not arch:
        raise ValueError(f"a GGUF draft architecture named {arch.name!r} is registered already")
    _ARCHITECTURES[arch.name] = arch
    return arch


def draft_architectures() -> dict[str, DraftArchitecture]:
    """The draft architectures draftsmith writes, every kind's GGUF module imported (the kinds register theirs)."""
    from draftsmith.export.engines import load_kind_exports  # the kinds' modules import this one

    load_kind_exports()
    return _ARCHITECTURES


def layer_shapes(i: int, d: Decoder, attn_in: int) -> dict:
    """Block ``i``'s tensors in llama.cpp's names; its attention projections read ``attn_in`` features."""
    H, heads, kv_heads, hd, ff = d.H, d.heads, d.kv_heads, d.hd, d.ff
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
    needs, the exact tensor set and shapes; for a draft architecture (an ``eagle3`` head, the kinds'
    registered ones) also what its own check finds (layer ids, ``d2t``)."""
    found = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if len(found) != 1:
        return [f"expected one .gguf file at {path}, found {len(found)}"]
    reader = read_gguf(found[0], "Export it again")  # a cut-short file: one line naming it
    fields = reader.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    drafts = draft_architectures()
    if arch != "llama" and arch not in drafts:
        known = ", ".join(f"{a.name!r} ({a.title})" for a in drafts.values())
        return [f"general.architecture must be 'llama' (a draft model) or one of {known}, got {arch!r}"]
    required = [f"{arch}.{k}" for k in HPARAM_KEYS] + list(TOKENIZER_KEYS)
    required += list(drafts[arch].keys) if arch in drafts else []
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
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    d = Decoder(
        reader, meta, shapes, H=meta["embedding_length"], L=meta["block_count"], V=meta["vocab_size"],
        heads=meta["attention.head_count"], kv_heads=meta["attention.head_count_kv"],
        hd=meta["rope.dimension_count"], ff=meta["feed_forward_length"],
    )  # fmt: skip
    if n_tokens != d.V:
        problems.append(f"{n_tokens} tokens but {arch}.vocab_size {d.V}")
    if arch == "llama":
        expected = {"token_embd.weight": (d.V, d.H), "output_norm.weight": (d.H,)}
        for i in range(d.L):
            expected |= layer_shapes(i, d, d.H)
        if "output.weight" in shapes:
            expected["output.weight"] = (d.V, d.H)
    else:
        expected, found_problems = drafts[arch].expected(d)
        problems += found_problems
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


def _eagle3_expected(d: Decoder) -> tuple[dict[str, tuple], list[str]]:
    """llama.cpp's eagle3 head: ``fc`` over the 3 taps, one block whose attention reads 2·H, its own
    ``output`` over the draft vocabulary (``d2t`` as absolute ids when reduced), the embedding optional."""
    problems = _check_eagle3_meta(d.reader, d.meta, d.L)
    d2t = next((t for t in d.reader.tensors if t.name == "d2t"), None)
    Vd = int(d2t.shape[0]) if d2t is not None else d.V
    H = d.H
    expected = {
        "fc.weight": (H, 3 * d.meta["target_hidden_size"]),
        "output_norm.weight": (H,),
        "output.weight": (Vd, H),
        "blk.0.attn_norm_2.weight": (H,),
        **layer_shapes(0, d, 2 * H),
    }
    if d2t is not None:
        expected["d2t"] = (Vd,)
        problems += check_d2t(d2t, d.V)
    fields = d.reader.fields
    if "eagle3.norm_before_fc" in fields and fields["eagle3.norm_before_fc"].contents():
        expected["enc.output_norm.weight"] = (3 * d.meta["target_hidden_size"],)
    if "token_embd.weight" in d.shapes:
        expected["token_embd.weight"] = (d.V, H)
    return expected, problems


register_architecture(DraftArchitecture(EAGLE3_ARCH, "an EAGLE-3 head", EAGLE3_KEYS, _eagle3_expected))


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


def check_d2t(d2t, vocab: int) -> list[str]:
    """A reduced vocabulary's ``d2t``: I64 absolute target ids, each once (llama.cpp asserts the type)."""
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
