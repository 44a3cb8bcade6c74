"""DFlash drafts as llama.cpp ``dflash`` GGUFs (export/gguf_dflash.py): the layout and its verifier, no build
needed (tests/test_llamacpp_dflash.py runs the files in llama.cpp)."""

from __future__ import annotations

import gguf
import pytest
import torch
from tiny import tiny_bpe_target_gguf

from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.export import export_checkpoint
from draftsmith.export import gguf_dflash as dflash_gguf
from draftsmith.export.gguf_dflash import dflash_fields, dflash_tensors
from draftsmith.export.gguf_verify import verify_gguf
from draftsmith.train.registry import build_objective


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """An untrained two-layer DFlash draft of the tiny target, with a 100-token vocabulary and with the target's."""
    root = tmp_path_factory.mktemp("gguf_dflash")
    target, target_gguf = tiny_bpe_target_gguf(root)
    counts = torch.arange(target.vocab_size).flip(0)
    out = {"target": target, "target_gguf": target_gguf}
    for vocab in (100, None):
        options = {"block_size": 4, "num_layers": 2, **({"draft_vocab_size": vocab} if vocab else {})}
        objective = build_objective("dflash", target, options, counts)
        draft = objective.build_draft().eval()
        objective.save(draft, root / f"v{vocab}" / "draft")
        out[vocab] = (draft, root / f"v{vocab}" / "draft")
    return out


def export(drafts, vocab, path):
    return export_checkpoint(
        locate_checkpoint(str(drafts[vocab][1])), "gguf", path, "f32", str(drafts["target_gguf"])
    )


@pytest.mark.parametrize("vocab", [100, None], ids=["draft-vocab", "target-vocab"])
def test_a_dflash_gguf_holds_llama_cpps_dflash_layout(drafts, vocab, tmp_path):
    draft, _ = drafts[vocab]
    file = export(drafts, vocab, tmp_path / "d.gguf")
    assert verify_gguf(file) == []
    reader = gguf.GGUFReader(file)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == "dflash" and fields["dflash.block_count"] == 2
    assert fields["dflash.block_size"] == 4
    assert fields["dflash.target_layers"] == [
        i + 1 for i in draft.config.capture_layer_ids
    ]  # input of layer L
    assert reader.fields["tokenizer.ggml.mask_token_id"].contents() == draft.config.mask_token_id
    tensors = {t.name: t for t in reader.tensors}
    assert "token_embd.weight" not in tensors  # the target's embedding
    assert ("output.weight" in tensors) == ("d2t" in tensors) == (vocab is not None)
    if vocab:  # absolute target ids, I64
        assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
        assert tensors["d2t"].data.tolist() == draft.d2t.tolist()
    state = draft.state_dict()
    for ours, theirs in [("layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"),  # not permuted: NeoX rope
                         ("layers.0.self_attn.k_norm.weight", "blk.0.attn_k_norm.weight"),
                         ("hidden_norm.weight", "enc.output_norm.weight"), ("fc.weight", "fc.weight")]:  # fmt: skip
        assert torch.equal(
            torch.from_numpy(tensors[theirs].data.copy()).reshape(state[ours].shape), state[ours]
        )


def without(tensors: dict, name: str) -> dict:
    return {k: v for k, v in tensors.items() if k != name}


def without_mask(config):
    return [f for f in dflash_fields(config) if f[0] != "tokenizer.ggml.mask_token_id"]


@pytest.mark.parametrize(
    ("config_change", "drop", "fields", "problem"),
    [
        ({"mask_token_id": 10**6}, None, None, "mask_token_id 1000000 is not a token"),
        ({"block_size": 1}, None, None, "dflash.block_size 1"),
        ({}, "layers.0.self_attn.k_norm.weight", None, "tensor blk.0.attn_k_norm.weight missing"),
        ({}, "d2t", None, "output.weight has shape (100, 32), expected (300, 32)"),
        ({}, None, without_mask, "tokenizer.ggml.mask_token_id missing"),
    ],
)
def test_the_verifier_refuses_what_llama_cpp_would_misread(
    drafts, tmp_path, monkeypatch, config_change, drop, fields, problem
):
    draft, _ = drafts[100]
    config = {**draft.config.to_dict(), **config_change}
    weights = dict(draft.state_dict())
    if drop == "d2t":  # a head over 100 tokens but no map: llama.cpp would score them as ids 0..99
        monkeypatch.setattr(dflash_gguf, "dflash_tensors", lambda w, c: without(dflash_tensors(w, c), "d2t"))
    elif drop:
        weights.pop(drop)
    if fields:
        monkeypatch.setattr(dflash_gguf, "dflash_fields", fields)
    file = dflash_gguf.write_dflash_gguf(config, weights, tmp_path / "d.gguf", drafts["target_gguf"], "f32")
    assert any(problem in p for p in verify_gguf(file)), verify_gguf(file)


def test_a_draft_reading_layers_out_of_order_is_refused(drafts, tmp_path):
    draft, _ = drafts[None]
    config = {**draft.config.to_dict(), "capture_layer_ids": [3, 1]}
    with pytest.raises(ValueError, match="ascending order"):
        dflash_gguf.write_dflash_gguf(config, draft.state_dict(), tmp_path / "d.gguf", drafts["target_gguf"])


def test_the_verifier_knows_a_draft_architecture_from_the_kind_that_registers_it(
    drafts, tmp_path, monkeypatch
):
    """The dflash check lives with the kind (gguf_dflash.py registers it); the engine's verifier knows only what
    is registered, and names it when refusing."""
    from draftsmith.export import gguf_verify

    file = export(drafts, 100, tmp_path / "d.gguf")
    assert verify_gguf(file) == []
    monkeypatch.delitem(gguf_verify._ARCHITECTURES, dflash_gguf.DFLASH_ARCH)
    (problem,) = verify_gguf(file)
    assert "got 'dflash'" in problem and "'eagle3' (an EAGLE-3 head)" in problem
    with pytest.raises(ValueError, match="registered already"):  # one record per name
        gguf_verify.register_architecture(
            gguf_verify.DraftArchitecture("eagle3", "another", (), lambda d: ({}, []))
        )
