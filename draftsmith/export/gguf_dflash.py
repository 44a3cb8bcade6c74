"""DFlash drafts as llama.cpp's ``dflash`` architecture (``src/models/dflash.cpp``, ``common/speculative.cpp``).

The names, metadata and conventions are those llama.cpp's own converter writes for a ``DFlashDraftModel``
(``convert_hf_to_gguf.py``, ``conversion/qwen.py`` ``DFlashModel``): the Qwen3 layer tensors
(``blk.N.attn_q`` ..., per-head ``attn_q_norm`` / ``attn_k_norm``, no q/k permutation: the ``dflash``
graph ropes NeoX-style, as draftsmith does), ``fc``, ``hidden_norm`` as ``enc.output_norm``, ``norm`` as
``output_norm``; ``dflash.block_size``; ``dflash.target_layers`` as the input of target layer L
(draftsmith id + 1, what ``llama_set_embeddings_layer_inp`` extracts); the mask token as the tokenizer's
``tokenizer.ggml.mask_token_id`` (``llama_vocab_mask``). The embedding and LM head are left to the
target's (``ctx_other``); a reduced draft vocabulary brings ``output`` and ``d2t`` as absolute target ids
(I64), as the converter's DSpark path writes them: its plain DFlash path would copy vLLM's offsets as
they are. The file is written with ``gguf.py``'s parts, as the EAGLE-3 heads are, for the reasons given
there (the converter refuses tokenizers it has no hash for, and wants the target's Hugging Face folder).
``write_dflash`` and ``usage`` are what the DFlash and DSpark kinds register for the ``gguf`` engine.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import GGUF
from draftsmith.drafts.taps import refuse_uncaptured_last_layer
from draftsmith.export.eagle import read_weights
from draftsmith.export.engines import CardContext, ExportOptions
from draftsmith.export.gguf import (
    AMX_NOTE,
    _add_decoder_hparams,
    _add_tensors,
    _check_dtype,
    _copy_fields,
    _write_file,
    check_target_gguf,
    gguf_file,
    required_target_gguf,
)
from draftsmith.export.gguf_verify import (
    Decoder,
    DraftArchitecture,
    check_d2t,
    layer_shapes,
    register_architecture,
)

DFLASH_ARCH = "dflash"
"""llama.cpp's architecture name for a block drafter (``src/models/dflash.cpp``)."""
DFLASH_KEYS = (f"{DFLASH_ARCH}.target_layers", f"{DFLASH_ARCH}.block_size", gguf.Keys.Tokenizer.MASK_ID)
"""Read by ``llama_model_dflash`` (target_layers: required) and ``common_speculative_impl_draft_dflash``
(block_size: 16 when missing; the mask token: ``llama_vocab_mask``, none without it)."""

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    **{f"self_attn.{p}_proj": f"attn_{p}" for p in "qkv"},
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    **{f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")},
}
TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
             "markov_head.markov_w1.weight": "markov_w1.weight",  # DSpark's Markov head (src/models/dflash.cpp)
             "markov_head.markov_w2.weight": "markov_w2.weight"}  # fmt: skip
SAMPLE_FROM_ANCHOR = f"{DFLASH_ARCH}.sample_from_anchor"
"""llama.cpp's DSpark graph: absent or true, slot 0 is drafted too; draftsmith's blocks need false."""
SKIPPED = ("t2d", "rotary_emb.inv_freq")
"""Saved with the draft, read by no llama.cpp loader (t2d: the inverse of d2t)."""


def _check_meta(d: Decoder) -> list[str]:
    """llama.cpp's DFlash drafter: ascending target layers >= 1 (the input of layer L; 0 is the embedding
    no target extracts), a block of the last token and at least one slot, a mask token of the vocabulary."""
    problems = []
    ids = [int(i) for i in d.reader.fields[f"{DFLASH_ARCH}.target_layers"].contents()]
    if not ids or ids != sorted(set(ids)) or ids[0] < 1:
        problems.append(
            f"{DFLASH_ARCH}.target_layers {ids} must be distinct, ascending and >= 1 (fc's columns follow that order)"
        )
    block = int(d.meta["block_size"])
    if block < 2:
        problems.append(
            f"{DFLASH_ARCH}.block_size {block}: a block holds the last token and at least one to draft"
        )
    mask = int(d.meta[gguf.Keys.Tokenizer.MASK_ID])
    if not 0 <= mask < d.V:
        problems.append(f"{gguf.Keys.Tokenizer.MASK_ID} {mask} is not a token of the vocabulary")
    return problems


def expected_tensors(d: Decoder) -> tuple[dict[str, tuple], list[str]]:
    """The tensors llama.cpp's dflash loader maps for this file's metadata: ``fc`` over the taps, Qwen3
    blocks (per-head q/k norms), the draft's own head and ``d2t`` for a reduced vocabulary (else the
    target's), the embedding optional; DSpark's Markov head ([V, r] by target ids, [Vd, r]) with slot 0
    passed through (``sample_from_anchor`` false)."""
    problems = _check_meta(d)
    H, V = d.H, d.V
    d2t = next((t for t in d.reader.tensors if t.name == "d2t"), None)
    taps = len(d.reader.fields[f"{DFLASH_ARCH}.target_layers"].contents())
    expected = {"fc.weight": (H, taps * H), "enc.output_norm.weight": (H,), "output_norm.weight": (H,)}
    for i in range(d.L):
        expected |= layer_shapes(i, d, H)
        expected |= {f"blk.{i}.attn_q_norm.weight": (d.hd,), f"blk.{i}.attn_k_norm.weight": (d.hd,)}
    if d2t is not None:  # the graph scatters the draft's own head's logits through d2t
        expected |= {"d2t": (int(d2t.shape[0]),), "output.weight": (int(d2t.shape[0]), H)}
        problems += check_d2t(d2t, V)
    elif "output.weight" in d.shapes:
        expected["output.weight"] = (V, H)
    if "token_embd.weight" in d.shapes:
        expected["token_embd.weight"] = (V, H)
    if "markov_w1.weight" in d.shapes:
        rank = d.shapes["markov_w1.weight"][1]
        expected |= {"markov_w1.weight": (V, rank), "markov_w2.weight": (expected.get("d2t", (V,))[0], rank)}
        anchor = d.reader.fields.get(SAMPLE_FROM_ANCHOR)
        if anchor is None or bool(anchor.contents()):
            problems.append(
                f"{SAMPLE_FROM_ANCHOR} is not false: llama.cpp would bias and draft slot 0, which holds "
                "the last token in draftsmith's blocks"
            )
    return expected, problems


register_architecture(DraftArchitecture(DFLASH_ARCH, "a block drafter", DFLASH_KEYS, expected_tensors))


def dflash_tensors(weights: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """DFlashDraft tensors → llama.cpp ``dflash`` tensors; ``d2t`` (absolute ids) only for a reduced
    vocabulary. A tensor without a llama.cpp name is an error (the loader would never read it)."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in weights.items():
        parts = name.split(".")
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = tensor.float()
        elif name == "d2t":
            out["d2t"] = tensor.long()
        elif parts[0] == "layers" and ".".join(parts[2:-1]) in LAYER_NAMES and parts[-1] == "weight":
            out[f"blk.{parts[1]}.{LAYER_NAMES['.'.join(parts[2:-1])]}.weight"] = tensor.float()
        elif name not in SKIPPED:
            unknown.append(name)
    if unknown:
        raise ValueError(f"llama.cpp's dflash architecture has no name for tensors {sorted(unknown)}")
    if int(config.get("draft_vocab_size") or config["vocab_size"]) < int(config["vocab_size"]):
        if "d2t" not in out or "output.weight" not in out:
            raise ValueError("the draft's vocabulary is reduced but it has no lm_head / d2t: save it again")
    else:
        out.pop("d2t", None)
        out.pop("output.weight", None)  # the target's LM head, as llama.cpp shares it
    return out


def dflash_fields(config: dict) -> list[tuple]:
    """The ``dflash.*`` metadata besides the decoder's hyper-parameters, and the mask token, as
    (key, value, type, array element type) — the form ``gguf.py`` copies tokenizer fields in."""
    ids = [int(i) + 1 for i in config["capture_layer_ids"]]  # the input of layer i + 1 = output of layer i
    fields = [
        (f"{DFLASH_ARCH}.block_size", int(config["block_size"]), gguf.GGUFValueType.UINT32, None),
        (f"{DFLASH_ARCH}.target_layers", ids, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32),
        (gguf.Keys.Tokenizer.MASK_ID, int(config["mask_token_id"]), gguf.GGUFValueType.UINT32, None),
    ]
    if config.get(
        "markov_rank"
    ):  # DSpark: slot 0 is the last token, passed through unbiased (fill-in layout)
        fields.append((SAMPLE_FROM_ANCHOR, False, gguf.GGUFValueType.BOOL, None))
    return fields


def check_dflash_exportable(config: dict) -> None:
    """Refuse a draft llama.cpp's dflash graph would run otherwise than draftsmith does."""
    ids = [int(i) for i in config.get("capture_layer_ids") or []]
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"the draft reads target layers {ids}; llama.cpp concatenates them in ascending order, once each. "
            "Train it on strictly increasing capture_layer_ids."
        )
    refuse_uncaptured_last_layer(ids, int((config.get("target") or {}).get("num_hidden_layers", 0)), GGUF)
    if int(config.get("hidden_size", 0)) != int((config.get("target") or {}).get("hidden_size", 0)):
        raise ValueError(
            "llama.cpp's dflash graph sizes fc by the draft's hidden size and feeds it the target's: they must "
            f"be equal (draft {config.get('hidden_size')}, target {(config.get('target') or {}).get('hidden_size')})"
        )


def write_dflash_gguf(config: dict, weights: dict[str, torch.Tensor], out_file: str | Path, target_gguf: Path,
                      dtype: str = "f16", name: str = DFLASH_ARCH) -> Path:  # fmt: skip
    """Write a DFlash draft (its ``config.json`` as a dict and its tensors) as a llama.cpp ``dflash`` GGUF;
    ``target_gguf`` is the GGUF of its target, whose tokenizer it copies after checking the pair."""
    _check_dtype(dtype)
    check_dflash_exportable(config)
    tokenizer_fields = check_target_gguf(Path(target_gguf), config["target"])
    tensors = dflash_tensors(weights, config)
    extra = dflash_fields(config)
    ours = {key for key, *_ in extra}

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_name(name)
        _add_decoder_hparams(writer, config, dtype)
        _copy_fields(writer, [f for f in tokenizer_fields if f[0] not in ours] + extra)
        _add_tensors(writer, tensors, dtype)

    return _write_file(Path(out_file), DFLASH_ARCH, fill)


def write_dflash(ckpt: DraftCheckpoint, out: Path, options: ExportOptions) -> Path:
    check_dflash_exportable(ckpt.config)
    source = required_target_gguf(ckpt, options, "a DFlash draft")
    name = (ckpt.run_dir or ckpt.draft_dir).resolve().name
    file = gguf_file(ckpt, out, options)
    return write_dflash_gguf(
        ckpt.config, read_weights(ckpt.draft_dir), file, source, options.gguf_dtype, name
    )


def usage(card: CardContext) -> list[str]:
    """llama-server running a block drafter's GGUF: a whole block each step (a shorter one is attended otherwise
    than trained)."""
    k = int(card.config.get("block_size", 2)) - 1
    return [
        "### llama.cpp / LM Studio",
        "",
        "```bash",
        f"draftsmith export {card.repo_id} --to gguf --out draft.gguf  # --target-gguf TARGET.gguf unless "
        "draftsmith knows it",
        f"llama-server -m TARGET.gguf --spec-type draft-dflash --spec-draft-model draft.gguf --spec-draft-n-max {k}",
        "```",
        "",
        *AMX_NOTE,
    ]
