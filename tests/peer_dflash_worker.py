"""Run inside a peer's own venv (scripts/install_peers.sh): load a DFlash draft draftsmith exported (SpecForge:
``--to sglang``, the folder vLLM also reads; speculators: ``--to speculators``) with the peer's own DFlash model class and run the peer's own forward on the inputs draftsmith wrote, so
tests/test_dflash_peers.py can hold draftsmith's forward against it; or (``save``) build a DFlash draft with
the peer's own class for a tiny target, save it as the peer saves it, and record the peer's own forward, so
the test can hold draftsmith's reading of the saved draft against it.

    PEER_VENV/bin/python tests/peer_dflash_worker.py PEER EXPORT_DIR IO_IN IO_OUT
    PEER_VENV/bin/python tests/peer_dflash_worker.py save PEER TARGET_DIR HEAD_OUT IO_IN IO_OUT SETTINGS_JSON

IO_IN holds ``block_embeds`` [1, Q, H] (the block's input embeddings), ``context`` [1, C, K·H] (the target
states at the tapped layers, concatenated in layer order), ``positions`` [1, C + Q], and for speculators (which
embeds the block itself) ``anchor`` and ``embed_tokens`` (the target's table); IO_OUT gets
``hidden`` [1, Q, H], the peer's normed output for the block. ``save`` reads ``anchor`` (the block's first
token) instead of ``block_embeds``, the peer embeds the block with the target's table itself; SETTINGS_JSON
holds ``layer_ids`` (draftsmith's convention: output of layer i), ``num_layers``, ``block_size``,
``mask_token_id`` and ``seed``. Imports nothing from draftsmith.
"""

from __future__ import annotations

import json
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
    """speculators' DFlashDraftModel from draftsmith's ``--to speculators`` folder (strictly: nothing missing or
    unexpected), the target's embedding table installed, and its own anchored-block forward."""
    from speculators.models.dflash import DFlashDraftModel

    model, info = DFlashDraftModel.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    loose = {key: sorted(names) for key, names in info.items() if names and key != "error_msgs"}
    if loose or info.get("error_msgs"):
        raise ValueError(f"speculators did not load {export} as saved: {loose} {info.get('error_msgs')}")
    model.eval().embed_tokens.weight.copy_(io["embed_tokens"])
    return speculators_block(model, io, model.config.block_size, io["embed_tokens"].shape[1])


def speculators_block(model, io: dict[str, torch.Tensor], Q: int, H: int) -> torch.Tensor:
    """speculators' own anchored-block forward (``_backbone_forward``) with one anchor at C, the only position its
    anchor rule can pick, so the block sees exactly the C context positions."""
    C = io["context"].shape[1]
    S = C + 2 * Q  # never seen by the block; its anchor rule leaves the last Q positions out
    ids = torch.zeros(1, S, dtype=torch.long)
    ids[0, C] = int(io["anchor"])
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[0, C] = 1
    context = torch.cat([io["context"], torch.zeros(1, S - C, io["context"].shape[-1])], dim=1)
    hidden, *_ = model._backbone_forward(
        context, ids, loss_mask, torch.randn(1, S, H), torch.zeros(1, S, dtype=torch.long), torch.arange(S)[None],
        max_anchors=1,
    )  # fmt: skip
    return hidden


PEERS = {"specforge": specforge_hidden, "speculators": speculators_hidden}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Fresh weights, norms moved off one (where a mapping slip between two norms cannot show)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_", "lm_head")):
                continue
            scale = 0.2 if "norm" in name else 0.1
            param.copy_((1 if "norm" in name else 0) + scale * torch.randn(param.shape, generator=gen))


def qwen3_config(target_dir: str, s: dict):
    """The draft decoder shaped like the target (as both peers derive it), all layers full attention."""
    from transformers import AutoConfig, Qwen3Config

    tc = AutoConfig.from_pretrained(target_dir)
    return Qwen3Config(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.hidden_size // tc.num_attention_heads,
        num_hidden_layers=s["num_layers"], vocab_size=tc.vocab_size, rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings, rope_theta=s.get("rope_theta", 10000.0),
        layer_types=["full_attention"] * s["num_layers"], tie_word_embeddings=False,
    ), tc  # fmt: skip


def specforge_saved(target_dir: str, head: str, io: dict, s: dict) -> torch.Tensor:
    """SpecForge's DFlashDraftModel, saved as its ``export --to hf`` saves it (``save_pretrained``), and its forward."""
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    config, tc = qwen3_config(target_dir, s)
    config.architectures = ["DFlashDraftModel"]
    config.block_size, config.num_target_layers = s["block_size"], tc.num_hidden_layers
    config.dflash_config = {"target_layer_ids": s["layer_ids"], "mask_token_id": s["mask_token_id"]}
    model = DFlashDraftModel(config).eval()
    randomize(model, s["seed"])
    model.save_pretrained(head)
    embed = AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings()
    ids = torch.full((1, s["block_size"]), s["mask_token_id"])
    ids[0, 0] = int(io["anchor"])
    return model(position_ids=io["positions"], noise_embedding=embed(ids), target_hidden=io["context"],
                 is_causal=False)  # fmt: skip


def speculators_saved(target_dir: str, head: str, io: dict, s: dict) -> torch.Tensor:
    """speculators' DFlashDraftModel (``from_training_args``, as its trainer builds it), saved with its
    ``save_pretrained``, and its own anchored-block forward."""
    from speculators.models.dflash import DFlashDraftModel

    config, _ = qwen3_config(target_dir, s)
    config._attn_implementation = "sdpa"
    torch.manual_seed(s["seed"])
    model = DFlashDraftModel.from_training_args(
        verifier_config=config, draft_vocab_size=config.vocab_size, block_size=s["block_size"],
        verifier_name_or_path=target_dir, target_layer_ids=[i + 1 for i in s["layer_ids"]],
        mask_token_id=s["mask_token_id"], draft_attn_impl="sdpa",
    ).eval()  # fmt: skip
    randomize(model, s["seed"])
    model.save_pretrained(head)
    return speculators_block(model, io, s["block_size"], config.hidden_size)


SAVERS = {"specforge": specforge_saved, "speculators": speculators_saved}


def main(argv: list[str]) -> None:
    if argv[0] == "save":
        peer, target_dir, head, io_in, io_out, settings = argv[1:]
        io = load_file(io_in)
        with torch.no_grad():
            hidden = SAVERS[peer](target_dir, head, io, json.loads(settings))
        save_file({"hidden": hidden.float().contiguous()}, io_out)
        return
    peer, export, io_in, io_out = argv
    io = load_file(io_in)
    with torch.no_grad():
        hidden = PEERS[peer](export, io)
    save_file({"hidden": hidden.float().contiguous()}, io_out)


if __name__ == "__main__":
    main(sys.argv[1:])
