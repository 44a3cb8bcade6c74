"""The peers' own DFlash classes read draftsmith's DFlash export (``--to vllm``) and compute what draftsmith
computes: SpecForge 0.2.0's ``DFlashDraftModel`` (and speculators' where its venv exists) on the same block,
context and positions, through the peer's own forward (tests/peer_dflash_worker.py, in the peer's venv); and
the other way: a DFlash draft a peer saved (SpecForge, speculators) reads into draftsmith
(``drafts/dflash_import.py``) as the peer's own forward computes it, decodes losslessly and exports."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_peer_heads import peer_python
from tiny import tiny_model, tiny_target, tiny_tokenizer

from draftsmith.decode.speculative import generate
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts.base import PEER_DFLASH, build_drafter, kind_of_checkpoint
from draftsmith.drafts.dflash import DFlashConfig, DFlashDraft, block_inputs
from draftsmith.drafts.dflash_import import import_dflash
from draftsmith.export import export_checkpoint, import_peer_head

WORKER = Path(__file__).with_name("peer_dflash_worker.py")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-layer DFlash draft for a tiny Llama with every norm moved off one (so a mapping slip between two
    norms shows), saved, exported for vLLM, and draftsmith's own forward on one block."""
    root = tmp_path_factory.mktemp("dflash_peers")
    tiny_model("llama", layers=6).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    target = tiny_target("llama", layers=6)
    draft = DFlashDraft(
        DFlashConfig.for_target(target, num_layers=2, block_size=8, capture_layer_ids=[1, 2, 4])
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
    draft.eval().save_pretrained(root / "draft")
    outs = {peer: export_checkpoint(locate_checkpoint(str(root / "draft")), engine, root / engine)
            for peer, engine in EXPORT_FOR.items()}  # fmt: skip
    C, H = 9, target.config.hidden_size
    features = {i: torch.randn(1, C, H, generator=gen) for i in draft.config.capture_layer_ids}
    ids, positions = block_inputs(torch.tensor([[42]]), torch.tensor([[C]]), 8, draft.config.mask_token_id)
    embeds = F.embedding(ids, target.model.get_input_embeddings().weight)
    with torch.no_grad():
        ours = draft(embeds, positions, torch.ones(1, 1, C, dtype=torch.bool), features=features,
                     feature_positions=torch.arange(C)[None])[0]  # fmt: skip
    io = {
        "block_embeds": embeds[0].contiguous(),
        "context": torch.cat([features[i] for i in draft.config.capture_layer_ids], -1).contiguous(),
        "positions": torch.arange(C + 8)[None],
        "anchor": torch.tensor(42),
        "embed_tokens": target.model.get_input_embeddings().weight.detach().contiguous(),
    }
    save_file(io, str(root / "io.safetensors"))
    return root, outs, ours[0], target


EXPORT_FOR = {"specforge": "sglang", "speculators": "speculators"}
"""The export each peer's class reads: SpecForge's DFlashDraftModel folder (what ``--to sglang`` and ``--to
vllm`` write), speculators' DFlashSpeculator."""


@pytest.mark.engine
@pytest.mark.parametrize("peer", list(EXPORT_FOR))
def test_the_peers_dflash_class_reads_our_export_and_gives_our_logits(exported, peer):
    root, outs, ours, target = exported
    out = outs[peer]
    python = peer_python(peer)
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([str(python), str(WORKER), peer, str(out), str(root / "io.safetensors"),
                           str(root / f"{peer}.safetensors")], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{peer} worker failed:\n{done.stderr[-3000:]}"
    theirs = load_file(str(root / f"{peer}.safetensors"))["hidden"][0]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    lm_head = target.model.get_output_embeddings()
    with torch.no_grad():
        torch.testing.assert_close(lm_head(theirs[1:]), lm_head(ours[1:]), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama target saved where a peer's venv can load it (its embedding embeds the peer's block)."""
    root = tmp_path_factory.mktemp("dflash_peer_saved")
    tiny_model("llama", layers=6).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    return root, tiny_target("llama", layers=6)


@pytest.mark.engine
@pytest.mark.parametrize("peer", ["specforge", "speculators"])
def test_a_dflash_draft_the_peer_saved_reads_as_the_peers_forward(tiny_llama, peer, tmp_path):
    """The peer builds and saves a DFlash draft with its own class (random weights, norms off one); draftsmith
    reads the saved folder (``drafts/dflash_import.py``) and computes the peer's own block hidden states."""
    root, target = tiny_llama
    python = peer_python(peer)
    settings = {"layer_ids": [1, 2, 4], "num_layers": 2, "block_size": 8, "mask_token_id": 7, "seed": 3}
    C, H, anchor = 9, target.config.hidden_size, 42
    gen = torch.Generator().manual_seed(1)
    features = {i: torch.randn(1, C, H, generator=gen) for i in settings["layer_ids"]}
    io = {"anchor": torch.tensor(anchor), "context": torch.cat(list(features.values()), -1).contiguous(),
          "positions": torch.arange(C + 8)[None]}  # fmt: skip
    save_file(io, str(tmp_path / "io.safetensors"))
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([str(python), str(WORKER), "save", peer, str(root / "target"), str(tmp_path / "head"),
                           str(tmp_path / "io.safetensors"), str(tmp_path / "out.safetensors"), json.dumps(settings)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{peer} worker failed:\n{done.stderr[-3000:]}"
    theirs = load_file(str(tmp_path / "out.safetensors"))["hidden"][0]

    assert kind_of_checkpoint(tmp_path / "head").name == PEER_DFLASH
    draft = import_dflash(target, tmp_path / "head")
    assert draft.config.capture_layer_ids == settings["layer_ids"] and draft.config.mask_token_id == 7
    ids, positions = block_inputs(
        torch.tensor([[anchor]]), torch.tensor([[C]]), 8, draft.config.mask_token_id
    )
    embeds = F.embedding(ids, target.model.get_input_embeddings().weight)
    with torch.no_grad():
        ours = draft(embeds, positions, torch.ones(1, 1, C, dtype=torch.bool), features=features,
                     feature_positions=torch.arange(C)[None])[0, 0]  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    # and through the app: decoded losslessly by draftsmith's decoder, exported for vLLM from the read draft
    drafter = build_drafter(str(tmp_path / "head"), target)
    prompt = torch.tensor(target.tokenizer("def add(a, b):", add_special_tokens=False).input_ids)
    assert (
        generate(target, prompt, drafter, 7, 12).tokens
        == generate(target, prompt, None, max_new_tokens=12).tokens
    )
    imported = import_peer_head(
        locate_checkpoint(str(tmp_path / "head")), str(root / "target"), tmp_path / "read"
    )
    assert export_checkpoint(imported, "vllm", tmp_path / "vllm").is_dir()


def test_what_the_reader_cannot_compute_is_refused_by_name(tiny_llama, tmp_path):
    root, target = tiny_llama
    draft = DFlashDraft(DFlashConfig.for_target(target, capture_layer_ids=[1, 2, 4]))
    draft.save_pretrained(root / "ours")
    out = export_checkpoint(locate_checkpoint(str(root / "ours")), "vllm", tmp_path / "vllm")
    assert kind_of_checkpoint(out).name == PEER_DFLASH  # our vLLM export is the DFlashDraftModel layout
    config = json.loads((out / "config.json").read_text())
    for edit, field in ((("layer_types", ["sliding_attention"]), "layer_types"),
                        (("dflash_config", {"target_layer_ids": [1, 2, 4]}), "mask_token_id"),
                        (("attention_bias", True), "attention_bias")):  # fmt: skip
        (out / "config.json").write_text(json.dumps({**config, edit[0]: edit[1]}))
        with pytest.raises(ValueError, match=field):
            import_dflash(target, out)
