"""Drafts as one GGUF file for llama.cpp / LM Studio: distilled Llama drafts, EAGLE-3 heads, the kinds' own.

Written with ``gguf.GGUFWriter`` under llama.cpp's names and metadata keys:

- a distilled draft in the ``llama`` architecture (``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``,
  ``output``; ``llama.*``, ``tokenizer.ggml.*``), which transformers' GGUF loader reads back too;
- an EAGLE-3 head in llama.cpp's ``eagle3`` architecture (``src/models/eagle3.cpp``): ``fc``, one block
  whose ``attn_norm`` normalizes the token embedding and ``attn_norm_2`` the fused feature, ``output_norm``,
  ``output`` over the draft vocabulary, ``d2t`` as absolute target ids (absent for a full vocabulary), and
  ``eagle3.target_layers`` in llama.cpp's convention (id L = the input of target layer L). The head's token
  embedding is left out: llama.cpp then embeds with the target's, which the head's is a frozen copy of;
- the draft architectures of other kinds, written with these parts by the kind's own GGUF module, which
  registers the writer and the architecture's check (``gguf_verify.register_architecture``).

q_proj and k_proj rows are permuted the way llama.cpp's converter does (its rotary pairs adjacent
dimensions; transformers undoes the permutation on load). The tokenizer goes in as metadata: copied from
a GGUF of the target when there is one (the bundled SmolLM2 target has one; it is what llama.cpp checks a
draft against), else written from the draft's byte-level BPE tokenizer (both in ``gguf_tokenizer.py``).

Why our own writer and not llama.cpp's ``convert_hf_to_gguf.py``: the converter recognises a tokenizer
only by a hash of how it splits a fixed text, from a table of known models, and refuses every other one
(the tests' tiny tokenizers, new tokenizers); and it needs the target's Hugging Face directory where the
bundled target is itself a GGUF. The real engine checks what we write (tests/test_llamacpp.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from draftsmith import __version__, files
from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import GGUF
from draftsmith.export import GGUF_WRITER_KEY, check_gguf_replaceable
from draftsmith.export.eagle import (
    NAME_MAP,
    ascending_capture,
    check_exportable,
    engine_layer_ids,
    read_weights,
)
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.gguf_tokenizer import (
    TARGET_GGUF_FIX,
    fields_with_prefix,
    source_tokenizer_fields,
    tokenizer_from_hf,
)
from draftsmith.export.gguf_verify import EAGLE3_ARCH, draft_architectures, verify
from draftsmith.loading import read_gguf

QTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
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


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, dtype: str) -> None:
    array = tensor.detach().cpu().numpy().astype(np.float32)
    qtype = QTYPES[dtype][0]
    if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)  # norms stay F32, as llama.cpp keeps them
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        if qtype == gguf.GGMLQuantizationType.Q8_0 and array.shape[-1] % 32:
            raise ValueError(
                f"q8_0 needs rows divisible by 32; {name} has {array.shape[-1]} columns: use f16"
            )
        data = gguf.quants.quantize(array, qtype)  # bf16 bits or q8_0 blocks, as llama.cpp reads them
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def _write_file(out_file: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None]) -> Path:
    """Atomically write one GGUF file whose metadata and tensors ``fill(writer)`` adds."""

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_string(GGUF_WRITER_KEY, f"draftsmith {__version__}")  # what --overwrite may replace
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return files.write_with(out_file, write)


def _add_decoder_hparams(writer: gguf.GGUFWriter, c: dict, dtype: str) -> None:
    """The hyper-parameters every llama.cpp decoder reads (keys prefixed by the writer's architecture)."""
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(float(c["rope_theta"]))
    writer.add_rope_dimension_count(c["head_dim"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_file_type(QTYPES[dtype][1])


def _copy_fields(writer: gguf.GGUFWriter, fields: list[tuple]) -> None:
    for key, value, kind, sub in fields:
        writer.add_key_value(key, value, kind, sub_type=sub)


def _check_dtype(dtype: str) -> None:
    if dtype not in QTYPES:
        raise ValueError(f"unknown GGUF dtype {dtype!r}; choose one of {', '.join(QTYPES)}")


def write_gguf(
    draft_dir: str | Path, out_file: str | Path, dtype: str = "f16", tokenizer_gguf: Path | None = None
) -> Path:
    """Write the causal-LM draft in ``draft_dir`` as a GGUF file; ``dtype`` is one of ``QTYPES``."""
    _check_dtype(dtype)
    draft_dir, out_file = Path(draft_dir), Path(out_file)
    config = AutoConfig.from_pretrained(draft_dir)
    check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    tensors = gguf_tensors(read_weights(draft_dir), config)
    vocab = tensors["token_embd.weight"].shape[0]
    rope = getattr(config, "rope_parameters", None) or {}
    hparams = {
        **{k: getattr(config, k) for k in ("max_position_embeddings", "hidden_size", "num_hidden_layers")},
        **{
            k: getattr(config, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")
        },
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        "vocab_size": vocab,
    }
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    source_fields = (
        source_tokenizer_fields(Path(tokenizer_gguf), tokens) if tokenizer_gguf is not None else None
    )

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_name(
            draft_dir.resolve().name if draft_dir.name != "draft" else draft_dir.resolve().parent.name
        )
        _add_decoder_hparams(writer, hparams, dtype)
        if source_fields is not None:
            _copy_fields(writer, source_fields)
        else:
            tokenizer_from_hf(writer, tokenizer, vocab)
        for name, tensor in tensors.items():
            _add_tensor(writer, name, tensor, dtype)

    return _write_file(out_file, "llama", fill)


# reference EAGLE-3 name (draftsmith.export.eagle.NAME_MAP's values) -> llama.cpp eagle3 tensor name
EAGLE3_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    **{f"midlayer.self_attn.{p}_proj.weight": f"blk.0.attn_{p}.weight" for p in "qkv"},
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    **{f"midlayer.mlp.{p}_proj.weight": f"blk.0.ffn_{p}.weight" for p in ("gate", "up", "down")},
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def eagle3_tensors(weights: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """EagleHead tensors → llama.cpp ``eagle3`` tensors: fc's blocks in ascending layer order, q/k rows
    permuted, ``d2t`` as absolute target ids unless the draft vocabulary is the target's."""
    reference = {NAME_MAP[name]: tensor for name, tensor in weights.items() if name in NAME_MAP}
    _, reference["fc.weight"] = ascending_capture(config["capture_layer_ids"], reference["fc.weight"])
    out = {gguf_name: reference[name].float() for name, gguf_name in EAGLE3_NAMES.items()}
    out["blk.0.attn_q.weight"] = permute_rows(out["blk.0.attn_q.weight"], config["num_attention_heads"])
    out["blk.0.attn_k.weight"] = permute_rows(out["blk.0.attn_k.weight"], config["num_key_value_heads"])
    if config["draft_vocab_size"] != config["vocab_size"]:
        out["d2t"] = reference["d2t"].long()
    if config.get("norm_before_fc"):  # one RMSNorm over the concatenated states, its blocks ordered as fc's
        _, norm = ascending_capture(config["capture_layer_ids"], weights["fuse_norm.weight"][None, :])
        out["enc.output_norm.weight"] = norm[0].float()
    return out


def gguf_fingerprint(reader: gguf.GGUFReader) -> str:
    """``draftsmith.loading.tokenizer_fingerprint`` of the tokenizer a GGUF file carries (padding rows aside)."""
    import hashlib

    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    h = hashlib.sha256()
    for idx, token in enumerate(tokens):
        if types[idx] != gguf.TokenType.UNUSED:
            h.update(f"{idx}\t{token}\n".encode())
    template = reader.fields.get("tokenizer.chat_template")
    h.update((template.contents() if template is not None else "").encode())
    return h.hexdigest()[:16]


def check_target_gguf(source: Path, target: dict) -> list[tuple]:
    """The tokenizer fields of ``source`` after checking it is a GGUF of the head's target ``target``."""
    reader = read_gguf(source, TARGET_GGUF_FIX)
    arch = reader.fields["general.architecture"].contents()
    if arch in draft_architectures():
        raise ValueError(
            f"{source} is a draft ({arch}), not its target; pass the target's GGUF with --target-gguf"
        )
    theirs = {
        "num_hidden_layers": reader.fields.get(f"{arch}.block_count"),
        "hidden_size": reader.fields.get(f"{arch}.embedding_length"),
    }
    problems = [
        f"{key} {field.contents() if field is not None else None} (the head's target: {target.get(key)})"
        for key, field in theirs.items()
        if field is None or field.contents() != target.get(key)
    ]
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_tokens != target.get("vocab_size"):
        problems.append(f"{n_tokens} tokens (the head's target: {target.get('vocab_size')})")
    if not problems and gguf_fingerprint(reader) != target.get("tokenizer_fingerprint"):
        problems.append(
            f"tokenizer fingerprint {gguf_fingerprint(reader)} (the head's target: {target.get('tokenizer_fingerprint')})"
        )
    if problems:
        raise ValueError(
            f"{source} is not a GGUF of the head's target {target.get('name')!r}: it has "
            + "; ".join(problems)
            + ". Pass --target-gguf with the GGUF of the target the head was trained for."
        )
    return fields_with_prefix(reader, "tokenizer.")


def write_eagle3_gguf(config: dict, weights: dict[str, torch.Tensor], out_file: str | Path, target_gguf: Path,
                      dtype: str = "f16", name: str = EAGLE3_ARCH) -> Path:  # fmt: skip
    """Write an EAGLE-3 head (its ``config.json`` as a dict and its tensors) as a llama.cpp ``eagle3``
    GGUF; ``target_gguf`` is the GGUF of its target, whose tokenizer it copies after checking the pair."""
    _check_dtype(dtype)
    check_exportable(config, GGUF.name)
    tokenizer_fields = check_target_gguf(Path(target_gguf), config["target"])
    tensors = eagle3_tensors(weights, config)
    hparams = {**config, "num_hidden_layers": 1}
    layer_ids = engine_layer_ids(sorted(config["capture_layer_ids"]), GGUF.name)

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_name(name)
        _add_decoder_hparams(writer, hparams, dtype)
        writer.add_array("eagle3.target_layers", layer_ids)  # llama.cpp LLM_KV_TARGET_LAYERS
        writer.add_uint32("eagle3.target_hidden_size", config["target"]["hidden_size"])
        # the first layer's residual: the fused feature itself, or (a variant) hidden_norm of it
        writer.add_bool("eagle3.norm_before_residual", bool(config.get("norm_before_residual")))
        if config.get("norm_before_fc"):
            writer.add_bool("eagle3.norm_before_fc", True)
        _copy_fields(writer, tokenizer_fields)
        _add_tensors(writer, tensors, dtype)

    return _write_file(Path(out_file), EAGLE3_ARCH, fill)


def _add_tensors(writer: gguf.GGUFWriter, tensors: dict[str, torch.Tensor], dtype: str) -> None:
    """Every tensor in ``dtype`` (norms F32), ``d2t`` as the I64 llama.cpp asserts."""
    for name, tensor in tensors.items():
        if name == "d2t":
            writer.add_tensor(name, tensor.numpy().astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
        else:
            _add_tensor(writer, name, tensor, dtype)


def target_gguf_of(ckpt: DraftCheckpoint, given: str | None) -> Path | None:
    """The GGUF of the draft's target: --target-gguf, the bundled SmolLM2 GGUF for its drafts, a target
    recorded as a .gguf file, else None."""
    if given:
        if not Path(given).is_file():
            raise FileNotFoundError(f"--target-gguf {given} does not exist")
        return Path(given)
    from draftsmith.loading import SMOLLM2_ALIAS, smollm2_gguf_path

    name = str(ckpt.target.get("name") or "")
    if name == SMOLLM2_ALIAS:
        return smollm2_gguf_path()
    if name.endswith(".gguf") and Path(name).is_file():
        return Path(name)
    return None


def gguf_file(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    """``out`` if it names a .gguf file, else a file named after the run in the folder ``out``; what a killed
    export of that file left beside it is removed."""
    if out.suffix == GGUF.file_suffix:
        return out
    file = out / f"{(ckpt.run_dir or ckpt.draft_dir).resolve().name}-{options.gguf_dtype}{GGUF.file_suffix}"
    files.remove_stale(file.parent, file.name)
    check_gguf_replaceable(file)  # a file of that name in the folder: replaced only if an export wrote it
    return file


def required_target_gguf(ckpt: DraftCheckpoint, options: ExportOptions, what: str) -> Path:
    """The target's GGUF a draft that reads the target's hidden states is served beside (its tokenizer)."""
    source = target_gguf_of(ckpt, options.target_gguf)
    if source is None:
        raise ValueError(
            f"the draft's target {ckpt.target.get('name')!r} has no GGUF that draftsmith knows; llama.cpp "
            f"serves {what} only beside a GGUF of its target. Convert the target with llama.cpp's "
            "convert_hf_to_gguf.py and pass it with --target-gguf FILE."
        )
    return source


def write_head(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    check_exportable(ckpt.config, GGUF.name)
    source = required_target_gguf(ckpt, options, "an EAGLE-3 head")
    name = (ckpt.run_dir or ckpt.draft_dir).resolve().name
    file = gguf_file(ckpt, out, options)
    return write_eagle3_gguf(
        ckpt.config, read_weights(ckpt.draft_dir), file, source, options.gguf_dtype, name
    )


def write_draft(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    file = gguf_file(ckpt, out, options)
    return write_gguf(ckpt.draft_dir, file, options.gguf_dtype, target_gguf_of(ckpt, options.target_gguf))


AMX_NOTE = [
    "(the command draftsmith's engine benchmark runs; add `--no-repack` on CPUs with AMX, "
    "ggml-org/llama.cpp#20824)",
    "",
]
"""The last lines of every llama.cpp section of the model card."""


def usage(card: CardContext) -> list[str]:
    """llama-server as draftsmith's engine benchmark runs it; a causal LM only in the Llama architecture."""
    family = card.kind.family.name
    if family == "causal_lm" and card.config.get("model_type") != "llama":
        return []
    k = card.k
    if family == "eagle":
        export = "--out head.gguf  # --target-gguf TARGET.gguf unless draftsmith knows it"
        spec, draft = "draft-eagle3", "head.gguf"
    else:
        export, spec, draft = "--gguf-dtype q8_0 --out draft.gguf", "draft-simple", "draft.gguf"
    return [
        "### llama.cpp / LM Studio",
        "",
        "```bash",
        f"draftsmith export {card.repo_id} --to gguf {export}",
        f"llama-server -m TARGET.gguf --spec-type {spec} --spec-draft-model {draft} --spec-draft-n-max {k}",
        "```",
        "",
        *AMX_NOTE,
    ]


GGUF.writers.update({"eagle": write_head, "causal_lm": write_draft})
GGUF.verify, GGUF.usage = verify, usage
