"""The peers' own DFlash classes read draftsmith's DFlash export (``--to vllm``) and compute what draftsmith
computes: SpecForge 0.2.0's ``DFlashDraftModel`` (and speculators' where its venv exists) on the same block,
context and positions, through the peer's own forward (tests/peer_dflash_worker.py, in the peer's venv)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_peer_heads import peer_python
from tiny import tiny_model, tiny_target, tiny_tokenizer

from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts.dflash import DFlashConfig, DFlashDraft, block_inputs
from draftsmith.export import export_checkpoint

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
    out = export_checkpoint(locate_checkpoint(str(root / "draft")), "vllm", root / "vllm")
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
    }
    save_file(io, str(root / "io.safetensors"))
    return root, out, ours[0], target


@pytest.mark.parametrize("peer", ["specforge"])
def test_the_peers_dflash_class_reads_our_export_and_gives_our_logits(exported, peer):
    root, out, ours, target = exported
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
