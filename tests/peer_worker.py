"""Run inside a peer's own venv (scripts/install_peers.sh): build a small EAGLE-3 head with the peer's own
model classes for a tiny target, save it in the peer's own export layout, and record the peer model's own
forward on fixed random inputs, so tests/test_peer_heads.py can hold draftsmith's import against it.

    PEER_VENV/bin/python tests/peer_worker.py PEER TARGET_DIR OUT_DIR SETTINGS_JSON

Writes OUT_DIR/head/ (the export) and OUT_DIR/io.safetensors: ``input_ids`` [1, T]; ``feature.{i}``
[1, T, H] the target states the head read, keyed by draftsmith's layer id (output of decoder layer i,
0-based); ``logits.{j}`` [1, T - 1 - j, Vd] the peer's draft logits of TTT step j at anchors 0..T-2-j
(anchor a: features of position a, token a + 1 + j). Imports nothing from draftsmith: it runs where
draftsmith is not installed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the peers compile norms and rotary; not needed here

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def randomize_norms(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Norm weights start at one, where a mapping mistake between two norms cannot show: move them."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))


def draft_vocab(vocab: int, size: int, generator: torch.Generator) -> dict[int, int]:
    """Random token counts over the target vocabulary (what a peer calibrates its draft vocabulary from)."""
    counts = torch.randint(1, 1000, (vocab,), generator=generator)
    return {i: int(c) for i, c in enumerate(counts)}


def truncated(logits: list[torch.Tensor], T: int) -> dict[str, torch.Tensor]:
    """Step j's logits at anchors 0..T-2-j: past them the token of step j lies beyond the sequence."""
    return {f"logits.{j}": x[:, : T - 1 - j].contiguous() for j, x in enumerate(logits)}


def speculators_head(target_dir: str, out: Path, s: dict) -> dict[str, torch.Tensor]:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    gen = torch.Generator().manual_seed(s["seed"])
    verifier = AutoConfig.from_pretrained(target_dir)
    verifier.num_hidden_layers = 1  # the draft's own decoder: one layer shaped like the target's
    d2t, t2d = build_vocab_mappings_from_distribution(
        draft_vocab(verifier.vocab_size, s["draft_vocab_size"], gen),
        s["draft_vocab_size"],
        verifier.vocab_size,
    )
    torch.manual_seed(s["seed"])
    model = Eagle3DraftModel.from_training_args(
        verifier_config=verifier,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=s["draft_vocab_size"],
        norm_before_residual=s.get("norm_before_residual", True),  # speculators train's defaults
        norm_before_fc=s.get("norm_before_fc", True),
        norm_output=s.get("norm_output", True),
        ttt_steps=s["ttt_steps"],
        verifier_name_or_path=target_dir,
        target_layer_ids=s["peer_layer_ids"],  # vLLM's convention: id L = the input of layer L
        draft_attn_impl="sdpa",
    ).eval()
    randomize_norms(model, gen)
    with torch.no_grad():  # the LM head comes from the verifier's rows; move it off them
        model.lm_head.weight.add_(0.05 * torch.randn(model.lm_head.weight.shape, generator=gen))
    model.save_pretrained(str(out / "head"))
    T, H = s["seq_len"], verifier.hidden_size
    ids = torch.randint(0, verifier.vocab_size, (1, T), generator=gen)
    features = {i - 1: torch.randn(1, T, H, generator=gen) for i in sorted(s["peer_layer_ids"])}
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach().clone()))
    # speculators pairs state t with token t + 1 itself (its shift_batch), so it is given them shifted
    with torch.no_grad():
        model(
            hidden_states=torch.cat([features[i] for i in sorted(features)], dim=-1)[:, :-1],
            input_ids=ids[:, 1:],
            document_ids=torch.zeros(1, T - 1, dtype=torch.long),
            position_ids=torch.arange(1, T)[None],
            ttt_steps=s["ttt_steps"],
        )
    hook.remove()
    return {"input_ids": ids, **{f"feature.{i}": f for i, f in features.items()}, **truncated(captured, T)}


def specforge_head(target_dir: str, out: Path, s: dict) -> dict[str, torch.Tensor]:
    from collections import Counter

    from safetensors.torch import load_file
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.export.to_sglang import export_to_sglang
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import AutoModelForCausalLM, LlamaConfig

    gen = torch.Generator().manual_seed(s["seed"])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tc = target.config
    config = LlamaConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        num_hidden_layers=1,
        vocab_size=tc.vocab_size,
        draft_vocab_size=s["draft_vocab_size"],
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=s.get("rope_theta", 10000.0),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle3"],
    )
    if s.get("peer_layer_ids") is not None:  # SGLang's field and convention: id i = the output of layer i
        config.eagle_config = {
            "eagle_aux_hidden_state_layer_ids": s["peer_layer_ids"],
            "use_aux_hidden_state": True,
        }
    torch.manual_seed(s["seed"])
    model = LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()
    d2t, t2d = process_token_dict_to_mappings(
        Counter(draft_vocab(tc.vocab_size, s["draft_vocab_size"], gen)), s["draft_vocab_size"], tc.vocab_size
    )
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        # SGLang embeds with the target's embedding
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    randomize_norms(model, gen)
    # `specforge export --to sglang` itself, from a checkpoint as its trainer saves one (training_state.pt)
    torch.save({"strategy": "eagle3", "draft_state_dict": model.state_dict()}, out / "training_state.pt")
    config.save_pretrained(str(out / "draft_config"))
    export_to_sglang(
        str(out / "training_state.pt"), str(out / "draft_config" / "config.json"), str(out / "head")
    )
    exported = load_file(
        str(out / "head" / "model.safetensors")
    )  # bfloat16, as SpecForge materializes drafts
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in exported.items()}, strict=False)
    assert not unexpected and all("embed" in k for k in missing), (missing, unexpected)
    T, H, L = s["seq_len"], tc.hidden_size, tc.num_hidden_layers
    ids = torch.randint(0, tc.vocab_size, (1, T), generator=gen)
    layers = s.get("peer_layer_ids") or [1, L // 2 - 1, L - 4]  # SpecForge's own default when none is set
    features = {i: torch.randn(1, T, H, generator=gen) for i in sorted(layers)}
    # SpecForge's own TTT loop (algorithms/eagle3/model.py OnlineEagle3Model.forward), the loss left out
    logits = []
    with torch.no_grad():
        hidden = model.project_hidden_states(torch.cat([features[i] for i in sorted(features)], dim=-1))
        mask = model.prepare_decoder_attention_mask(
            attention_mask=torch.ones(1, T, dtype=torch.bool), hidden_states=hidden, batch_size=1,
            seq_length=T, past_key_values_length=0,
        )  # fmt: skip
        cache_hidden: list[list[torch.Tensor]] = [[], []]
        step_ids = ids
        for _ in range(s["ttt_steps"]):
            # token a + 1 + j at anchor a
            step_ids = torch.cat([step_ids[:, 1:], step_ids.new_zeros(1, 1)], dim=1)
            emb = model.embed_input_ids(step_ids).to(hidden.dtype)
            hidden = model.backbone(
                input_embeds=emb, hidden_states=hidden, cache_hidden=cache_hidden, attention_mask=mask,
                position_ids=torch.arange(T)[None], past_key_values=None, use_cache=True,
            )  # fmt: skip
            logits.append(model.compute_logits(hidden))
    return {"input_ids": ids, **{f"feature.{i}": f for i, f in features.items()}, **truncated(logits, T)}


def modelopt_head(target_dir: str, out: Path, s: dict) -> dict[str, torch.Tensor]:
    import modelopt.torch.speculative as mtsp
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(s["seed"])
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tc = model.config
    arch = {
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": tc.head_dim,
        "draft_vocab_size": s["draft_vocab_size"],
    }
    if s.get("peer_layer_ids") is not None:  # ModelOpt's convention: 0-based outputs of decoder layers
        arch["eagle_aux_hidden_state_layer_ids"] = s["peer_layer_ids"]
    cfg = {
        "eagle_decoder_type": "llama",
        "eagle_architecture_config": arch,
        "eagle_use_torch_compile": False,
        "eagle_ttt_steps": s["ttt_steps"],
    }
    if not s.get("export_rope_scaling", True):
        cfg["eagle_export_rope_scaling"] = {}
    torch.manual_seed(s["seed"])
    mtsp.convert(model, [("eagle", cfg)])
    em = model.eagle_module
    V, Vd = tc.vocab_size, s["draft_vocab_size"]
    if Vd < V:  # ModelOpt's d2t holds offsets: target id = draft id + d2t[draft id]
        kept = torch.randperm(V, generator=gen)[:Vd].sort().values
        with torch.no_grad():
            em.d2t.copy_(kept - torch.arange(Vd))
    randomize_norms(em, gen)
    model.get_exporter().export(out / "head")
    layers = list(model.eagle_config.eagle_aux_hidden_state_layer_ids)
    T = s["seq_len"]
    ids = torch.randint(0, V, (1, T), generator=gen)
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[i].register_forward_hook(
            lambda _m, _i, o, i=i: captured.setdefault(i, o.detach().clone())
        )
        for i in layers
    ]
    logits: list[torch.Tensor] = []
    hooks.append(em.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o.detach().clone())))
    model.train()  # ModelOpt unrolls its TTT steps only in training mode (no dropout in the head)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for h in hooks:
        h.remove()
    # ModelOpt's step j sits at position a + j for anchor a (it rolls its outputs); realign to anchors
    anchored = [x[:, j:] for j, x in enumerate(logits)]
    return {"input_ids": ids, **{f"feature.{i}": f for i, f in captured.items()}, **truncated(anchored, T)}


PEERS = {"speculators": speculators_head, "specforge": specforge_head, "modelopt": modelopt_head}


def main(argv: list[str]) -> int:
    peer, target_dir, out, settings = argv
    out = Path(out)
    (out / "head").mkdir(parents=True, exist_ok=True)
    tensors = PEERS[peer](target_dir, out, json.loads(settings))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "io.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
