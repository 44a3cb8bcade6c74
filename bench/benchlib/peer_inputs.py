"""What the peers' offline EAGLE-3 and DFlash training reads, made from draftsmith's own (``bench/peer_training.py``).

The same tokens for every run: the rows draftsmith's loop trains on first, until a token budget, split back
into conversations (the peers pad or pack conversations themselves). Then the stand-in for SGLang's / vLLM's
hidden-state capture, which do not run here: the target run by transformers over each conversation, written
as SpecForge's ``.ckpt`` files and as speculators' ``hs_{i}.safetensors`` with its preprocessed dataset.
DFlash reads the same captures (its taps are EAGLE-3's layers); only SpecForge's record differs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import datasets
import torch
from safetensors.torch import save_file

from draftsmith import files
from draftsmith.drafts.base import DFLASH, EAGLE3
from draftsmith.train.sampler import ResumableSampler

Capture = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""input ids of one conversation → (aux [T, 3H], last [T, H] before the final norm, normed [T, H])."""


def sampler_order(num_rows: int, batch_size: int, seed: int, count: int) -> list[int]:
    """The first ``count`` training rows draftsmith's loop takes (its ResumableSampler, epoch by epoch)."""
    sampler = ResumableSampler(num_rows, batch_size, seed=seed, rank=0, world_size=1)
    order: list[int] = []
    while len(order) < count:
        order.extend(iter(sampler))
        sampler.epoch += 1
    return order[:count]


def steps_for_budget(row_lengths: list[int], tokens: int, batch_size: int) -> int:
    """Optimizer steps of ``batch_size`` rows (lengths in training order) until ``tokens`` are seen."""
    if tokens < 1:
        raise ValueError(f"--tokens must be positive, got {tokens}")
    seen, rows = 0, 0
    while seen < tokens:
        if rows >= len(row_lengths):
            raise ValueError(f"{len(row_lengths)} rows hold only {seen} tokens, fewer than {tokens}")
        seen += row_lengths[rows]
        rows += 1
    return -(-rows // batch_size)


def conversations_of(row: dict) -> list[dict[str, list[int]]]:
    """A packed row split back into its conversations (``position_ids`` restart at 0 at each)."""
    ids, mask = row["input_ids"], row["loss_mask"]
    positions = row.get("position_ids") or list(range(len(ids)))
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
    if starts[0] != 0:
        raise ValueError("a packed row must start a conversation at position 0")
    return [{"input_ids": ids[a:b], "loss_mask": mask[a:b]} for a, b in zip(starts, starts[1:]) if b > a]


def token_counts(convs: list[dict]) -> dict[str, int]:
    """Positions, loss-mask tokens and conversations in ``convs``."""
    return {
        "positions": sum(len(c["input_ids"]) for c in convs),
        "loss_tokens": sum(sum(c["loss_mask"]) for c in convs),
        "conversations": len(convs),
    }


def capture(model, input_ids: list[int], layers: list[int]):
    """(aux [T, 3H], last [T, H] before the final norm, normed [T, H]) of the target on one conversation."""
    outputs: dict[int, torch.Tensor] = {}
    decoder = model.model
    wanted = sorted(set(layers) | {len(decoder.layers) - 1})

    def keep(index):
        def hook(_module, _inputs, output):
            outputs[index] = (output[0] if isinstance(output, tuple) else output)[0]

        return hook

    handles = [decoder.layers[i].register_forward_hook(keep(i)) for i in wanted]
    handles.append(decoder.norm.register_forward_hook(keep(-1)))
    try:
        with torch.no_grad():
            decoder(input_ids=torch.tensor([input_ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([outputs[i] for i in layers], dim=-1)
    return aux, outputs[len(decoder.layers) - 1], outputs[-1]


def specforge_record(conv: dict, aux, normed) -> dict:
    """One SpecForge offline ``.ckpt`` record (its reader's keys; final hidden state after the norm)."""
    return {
        "input_ids": torch.tensor(conv["input_ids"], dtype=torch.long),
        "loss_mask": torch.tensor(conv["loss_mask"], dtype=torch.long),
        "hidden_state": normed.to(torch.bfloat16)[None],
        "aux_hidden_state": aux.to(torch.bfloat16)[None],
    }


def specforge_dflash_record(conv: dict, aux, normed) -> dict:
    """One SpecForge offline ``.ckpt`` record for its DFlash trainer: the tapped states concatenated in layer
    order as ``hidden_states`` (its DFlash schema name); it learns the data's tokens, so no final state."""
    return {
        "input_ids": torch.tensor(conv["input_ids"], dtype=torch.long),
        "loss_mask": torch.tensor(conv["loss_mask"], dtype=torch.long),
        "hidden_states": aux.to(torch.bfloat16)[None],
    }


SPECFORGE_RECORDS = {EAGLE3: specforge_record, DFLASH: specforge_dflash_record}
"""Draft kind the bench trains -> SpecForge's offline record for it (speculators reads one layout for both)."""
DFLASH_SHAPE = {"num_layers": 1, "block_size": 8}
"""The DFlash draft every run of ``bench/peer_training.py --draft dflash`` trains."""


def draftsmith_dflash_draft() -> dict:
    """The quickstart recipe's ``draft`` section for the bench's DFlash run (DFlash's defaults otherwise)."""
    return {"kind": DFLASH, "options": dict(DFLASH_SHAPE)}


def speculators_record(conv: dict, aux, last) -> dict:
    """One speculators ``hs_{i}.safetensors``: the three states, then the last layer's (before the norm)."""
    T, H = last.shape
    states = torch.cat([aux.reshape(T, -1, H), last[:, None]], dim=1)
    return {
        "hidden_states": states.to(torch.bfloat16).contiguous(),
        "token_ids": torch.tensor(conv["input_ids"]),
    }


def write_speculators_index(
    root: Path, train: list[dict], heldout: list[dict], assistant_counts: dict
) -> None:
    """speculators' preprocessed dataset (arrow: input_ids, loss_mask, seq_len; training conversations
    first, then the held-out ones), ``split.json`` with the two counts, and ``token_freq.pt`` (assistant
    token counts, what speculators counts)."""
    convs = train + heldout
    dataset = datasets.Dataset.from_dict(
        {
            "input_ids": [c["input_ids"] for c in convs],
            "loss_mask": [c["loss_mask"] for c in convs],
            "seq_len": [len(c["input_ids"]) for c in convs],
        }
    )
    dataset.set_format(type="torch")  # as speculators' preprocessing saves it
    dataset.save_to_disk(str(root))
    torch.save(assistant_counts, root / "token_freq.pt")
    # last: its presence says the capture is whole (bench/dflash_peers.sh)
    files.write_text(root / "split.json", json.dumps({"train": len(train), "heldout": len(heldout)}))


def write_peer_features(train: list[dict], heldout: list[dict], captured: Capture, specforge: Path,
                        speculators: Path, assistant_counts: dict, draft: str = EAGLE3,
                        stamp: dict | None = None) -> tuple[int, int]:  # fmt: skip
    """Capture every conversation (``captured``) into SpecForge's ``specforge/{train,heldout}/`` (its record
    for ``draft``) and speculators' ``speculators/`` (its hidden states and dataset); returns the positions of
    all conversations and of those this call captured.

    Resumable: each conversation's two files land whole (written aside, then renamed), so a capture stopped part
    way (an hour at 1.6M tokens on a CPU) goes on from the conversations it has not written, provided it captures
    the same thing: ``stamp`` (what was captured: data, target, dtype, layers, draft) is kept beside the files,
    and a capture under another stamp (or none) starts over. speculators' ``split.json`` is written last."""
    state = speculators / "capture_stamp.json"
    stamp = {**(stamp or {}), "draft": draft}
    if not state.is_file() or json.loads(state.read_text()) != stamp:
        shutil.rmtree(specforge, ignore_errors=True)
        shutil.rmtree(speculators, ignore_errors=True)
    (speculators / "hidden_states").mkdir(parents=True, exist_ok=True)
    files.write_text(state, json.dumps(stamp, sort_keys=True))
    record, here = SPECFORGE_RECORDS[draft], 0
    for split, convs, offset in (("train", train, 0), ("heldout", heldout, len(train))):
        (specforge / split).mkdir(parents=True, exist_ok=True)
        for i, conv in enumerate(convs):
            ckpt = specforge / split / f"data_{i:06d}.ckpt"
            states = speculators / "hidden_states" / f"hs_{offset + i}.safetensors"
            if ckpt.is_file() and states.is_file():  # this capture's, before it was stopped
                continue
            aux, last, normed = captured(conv["input_ids"])
            save_whole(ckpt, record(conv, aux, normed), states, speculators_record(conv, aux, last))
            here += len(conv["input_ids"])
    write_speculators_index(speculators, train, heldout, assistant_counts)
    return sum(len(c["input_ids"]) for c in train + heldout), here


def save_whole(ckpt: Path, specforge_record: dict, states: Path, speculators_record: dict) -> None:
    """One conversation's two files, each written aside and renamed into place (never seen half written)."""
    files.write_with(ckpt, lambda tmp: torch.save(specforge_record, tmp))
    files.write_with(states, lambda tmp: save_file(speculators_record, str(tmp)))
