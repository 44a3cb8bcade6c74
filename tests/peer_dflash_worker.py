"""Run inside a peer's own venv (scripts/install_peers.sh): load a DFlash draft draftsmith exported for vLLM
with the peer's own DFlash model class and run the peer's own forward on the inputs draftsmith wrote, so
tests/test_dflash_peers.py can hold draftsmith's forward against it.

    PEER_VENV/bin/python tests/peer_dflash_worker.py PEER EXPORT_DIR IO_IN IO_OUT

IO_IN holds ``block_embeds`` [1, Q, H] (the block's input embeddings), ``context`` [1, C, K·H] (the target
states at the tapped layers, concatenated in layer order) and ``positions`` [1, C + Q]; IO_OUT gets
``hidden`` [1, Q, H], the peer's normed output for the block. Imports nothing from draftsmith.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def specforge_hidden(export: str, io: dict[str, torch.Tensor]) -> torch.Tensor:
    from specforge.modeling.draft.dflash import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    return model(position_ids=io["positions"], noise_embedding=io["block_embeds"], target_hidden=io["context"],
                 is_causal=False)  # fmt: skip


def speculators_hidden(export: str, io: dict[str, torch.Tensor]) -> torch.Tensor:
    raise NotImplementedError("speculators' DFlash reader: see tests/test_dflash_peers.py")


PEERS = {"specforge": specforge_hidden, "speculators": speculators_hidden}


def main(argv: list[str]) -> None:
    peer, export, io_in, io_out = argv
    io = load_file(io_in)
    with torch.no_grad():
        hidden = PEERS[peer](export, io)
    save_file({"hidden": hidden.float().contiguous()}, io_out)


if __name__ == "__main__":
    main(sys.argv[1:])
