"""Run inside SpecForge's venv (scripts/install_peers.sh): load a P-EAGLE head draftsmith exported ``--to sglang``
with SpecForge 0.2.0's own ``PEagleDraftModel`` (strictly) and run its own forward, causal, over the real pairs
and the parallel slots draftsmith's drafter runs, so tests/test_peagle.py can hold draftsmith's logits against it.

    SPECFORGE_VENV/bin/python tests/peer_peagle_worker.py EXPORT_DIR IO_IN IO_OUT

IO_IN holds ``context`` [1, P, 3·H] (the target states of the P real pairs, concatenated in ascending layer
order, as the export's ``fc`` reads them), ``ids`` [1, P] (each pair's next token) and ``slots`` (how many mask
slots follow). IO_OUT gets ``logits`` [1 + slots, Vd]: the last real pair's and every slot's draft logits.
Imports nothing from draftsmith.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def main(export: str, io_in: str, io_out: str) -> None:
    from specforge.modeling.draft.peagle import PEagleDraftModel
    from torch.nn.attention.flex_attention import create_block_mask

    model = PEagleDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    saved = load_file(os.path.join(export, "model.safetensors"))
    built = model.state_dict()
    loose = sorted(set(saved) ^ set(built)) + [
        n for n in saved if n in built and saved[n].shape != built[n].shape
    ]
    if loose:  # its from_pretrained reports nothing: held against the file, name by name
        raise ValueError(f"SpecForge's PEagleDraftModel and {export} disagree on {loose}")
    io = load_file(io_in)
    context, ids, slots = io["context"], io["ids"], int(io["slots"])
    P = ids.shape[1]
    mask_id = torch.tensor([[model.config.mask_token_id] * slots])
    hidden = torch.cat([context, model.mask_hidden.expand(1, slots, -1)], dim=1)
    embeds = model.embed_tokens(torch.cat([ids, mask_id], dim=1))
    S = P + slots
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cpu")
    with torch.no_grad():
        normed = model(hidden, embeds, attention_mask=causal, position_ids=torch.arange(S)[None])
        logits = model.lm_head(normed[0, P - 1 :])
    save_file({"logits": logits.contiguous()}, io_out)


if __name__ == "__main__":
    main(*sys.argv[1:])
