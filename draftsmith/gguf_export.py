"""Distilled Llama-architecture drafts as one GGUF file, for llama.cpp / LM Studio draft models.

Written with ``gguf.GGUFWriter`` under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` ...,
``output_norm``, ``output``) and metadata keys (``llama.*``, ``tokenizer.ggml.*``), which is also
what transformers' GGUF loader reads back. q_proj and k_proj rows are permuted the way llama.cpp's
converter does (its rotary pairs adjacent dimensions; transformers undoes the permutation on load).
The tokenizer goes in as metadata: copied from a GGUF of the target when there is one (the bundled
SmolLM2 target has one), else written from the draft's byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from draftsmith.eagle_export import read_weights

QTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


def check_supported(config) -> None:
    """Refuse what this writer cannot express in llama.cpp's ``llama`` architecture."""
    if config.model_type != "llama":
        raise ValueError(
            f"GGUF export writes Llama-architecture drafts; this draft is {config.model_type!r}. Distil a draft of "
            "a Llama-architecture target, or use `--to hf` / `--to vllm`."
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"GGUF export supports plain RoPE only; this draft uses {rope.get('rope_type')!r} scaling"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ValueError(f"GGUF export does not write biases; this draft has {flag}=True")
    if config.hidden_act != "silu":
        raise ValueError(f"GGUF export expects SiLU MLPs; this draft uses {config.hidden_act!r}")


def permute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k permutation: per head, interleave the two rotary halves [a0..an, b0..bn] → [a0 b0 ...]."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_tensors(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """HF Llama tensor names → llama.cpp names (q/k permuted); any tensor left unmapped is an error."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in weights.items():
        tensor = tensor.float()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = tensor
        elif name == "model.norm.weight":
            out["output_norm.weight"] = tensor
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["output.weight"] = tensor
        elif (m := LAYER_KEY.match(name)) and m.group(2) in LAYER_NAMES:
            layer, part = int(m.group(1)), m.group(2)
            if part == "self_attn.q_proj":
                tensor = permute_rows(tensor, config.num_attention_heads)
            elif part == "self_attn.k_proj":
                tensor = permute_rows(tensor, config.num_key_value_heads)
            out[f"blk.{layer}.{LAYER_NAMES[part]}.weight"] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"GGUF export has no llama.cpp name for tensors {sorted(unknown)}")
    if not config.tie_word_embeddings and "output.weight" not in out:
        raise ValueError("the draft's config says its LM head is not tied, but it has no lm_head.weight")
    return out


def _source_tokenizer_fields(source: Path, tokens: list[str]) -> list[tuple]:
    """tokenizer.* metadata of ``source`` (a GGUF of the target), after checking it spells ``tokens``."""
    reader = gguf.GGUFReader(str(source))
    field = reader.fields.get("tokenizer.ggml.tokens")
    theirs = list(field.contents()) if field is not None else []
    if theirs[: len(tokens)] != tokens or len(theirs) != len(tokens):
        raise ValueError(
            f"{source} has another vocabulary than the draft's tokenizer ({len(theirs)} vs {len(tokens)} tokens, or "
            "spelled differently); pass the GGUF of the draft's own target with --tokenizer-gguf"
        )
    fields = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, f.contents(), f.types[0], sub))
    return fields


def _tokenizer_from_hf(writer: gguf.GGUFWriter, tokenizer, vocab_size: int) -> None:
    """Write a byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``) from the draft's tokenizer files."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(backend.get("pre_tokenizer")):
        raise ValueError(
            "GGUF export writes byte-level BPE tokenizers (GPT-2 style) only; pass --tokenizer-gguf with a GGUF of "
            "the target to copy its tokenizer instead"
        )
    id_to_token = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    added = {i for i in tokenizer.added_tokens_decoder}
    tokens, types = [], []
    for i in range(vocab_size):
        token = id_to_token.get(i)
        if token is None:  # the model scores more ids than the tokenizer has: padding rows
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(token)
        kind = gguf.TokenType.NORMAL
        if i in special:
            kind = gguf.TokenType.CONTROL
        elif i in added:
            kind = gguf.TokenType.USER_DEFINED
        types.append(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:
        raise ValueError(
            "the draft's BPE tokenizer has no merges, and llama.cpp refuses a gpt2 tokenizer without them; pass "
            "--tokenizer-gguf with a GGUF of the target"
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
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


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, dtype: str) -> None:
    array = tensor.detach().cpu().numpy().astype(np.float32)
    qtype = QTYPES[dtype][0]
    if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)  # norms stay F32, as llama.cpp keeps them
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        if array.shape[-1] % 32:
            raise ValueError(
                f"q8_0 needs rows divisible by 32; {name} has {array.shape[-1]} columns: use f16"
            )
        data = gguf.quants.quantize(array, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def write_gguf(
    draft_dir: str | Path, out_file: str | Path, dtype: str = "f16", tokenizer_gguf: Path | None = None
) -> Path:
    """Write the causal-LM draft in ``draft_dir`` as a GGUF file; ``dtype`` is f32, f16 or q8_0."""
    if dtype not in QTYPES:
        raise ValueError(f"unknown GGUF dtype {dtype!r}; choose one of {', '.join(QTYPES)}")
    draft_dir, out_file = Path(draft_dir), Path(out_file)
    config = AutoConfig.from_pretrained(draft_dir)
    check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    tensors = gguf_tensors(read_weights(draft_dir), config)
    vocab = tensors["token_embd.weight"].shape[0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))

    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(
        draft_dir.resolve().name if draft_dir.name != "draft" else draft_dir.resolve().parent.name
    )
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_file_type(QTYPES[dtype][1])
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    if tokenizer_gguf is not None:
        for key, value, kind, sub in _source_tokenizer_fields(Path(tokenizer_gguf), tokens):
            writer.add_key_value(key, value, kind, sub_type=sub)
    else:
        _tokenizer_from_hf(writer, tokenizer, vocab)
    for name, tensor in tensors.items():
        _add_tensor(writer, name, tensor, dtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out_file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out_file


REQUIRED_KEYS = (
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.vocab_size",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
)


def verify_gguf(path: Path) -> list[str]:
    """Problems a GGUF draft has for llama.cpp / transformers: metadata the loader needs, exact tensor set, shapes."""
    files = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if len(files) != 1:
        return [f"expected one .gguf file at {path}, found {len(files)}"]
    reader = gguf.GGUFReader(str(files[0]))
    fields = reader.fields
    problems = [f"metadata {k} missing (the loader would guess it)" for k in REQUIRED_KEYS if k not in fields]
    if "general.architecture" not in fields or fields["general.architecture"].contents() != "llama":
        problems.append("general.architecture must be 'llama'")
    if problems:
        return problems
    meta = {k: fields[k].contents() for k in REQUIRED_KEYS if k != "tokenizer.ggml.tokens"}
    n_tokens = len(fields["tokenizer.ggml.tokens"].data)
    if meta["tokenizer.ggml.model"] == "gpt2" and "tokenizer.ggml.merges" not in fields:
        problems.append("a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges")
    if "general.name" in fields and "mistral" in str(fields["general.name"].contents()).lower():
        problems.append(
            "general.name contains 'mistral': transformers would load the file as a Mistral model"
        )
    H, L = meta["llama.embedding_length"], meta["llama.block_count"]
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    hd, ff, V = (
        meta["llama.rope.dimension_count"],
        meta["llama.feed_forward_length"],
        meta["llama.vocab_size"],
    )
    if n_tokens != V:
        problems.append(f"{n_tokens} tokens but llama.vocab_size {V}")
    expected = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    for i in range(L):
        expected |= {
            f"blk.{i}.attn_norm.weight": (H,),
            f"blk.{i}.ffn_norm.weight": (H,),
            f"blk.{i}.attn_q.weight": (heads * hd, H),
            f"blk.{i}.attn_k.weight": (kv_heads * hd, H),
            f"blk.{i}.attn_v.weight": (kv_heads * hd, H),
            f"blk.{i}.attn_output.weight": (H, heads * hd),
            f"blk.{i}.ffn_gate.weight": (ff, H),
            f"blk.{i}.ffn_up.weight": (ff, H),
            f"blk.{i}.ffn_down.weight": (H, ff),
        }
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    if "output.weight" in shapes:
        expected["output.weight"] = (V, H)
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
