"""SpecForge 0.2.0's EAGLE-3 training (``specforge train -c run.yaml``, offline mode), then ``export --to sglang``.

Run by bench/peer_training.py with the specforge venv's python. Where this departs from SpecForge's
own pipeline, and why:

- Features: SpecForge captures them with SGLang (online, or its offline capture), which does not run
  here; bench/peer_training.py's capture stage wrote its offline ``.ckpt`` layout (``input_ids``,
  ``loss_mask``, ``hidden_state`` = the final hidden state after the norm, which its ``TargetHead``
  turns into logits, ``aux_hidden_state`` = the outputs of layers 1, L/2-1, L-4, SGLang's default)
  from transformers, in bfloat16 as SGLang writes them (``TargetHead`` casts its weight to bfloat16).
- ``specforge.core.loss`` imports triton and its ``LogSoftmaxLoss`` is a Triton kernel with no CPU path:
  the module is replaced, before SpecForge imports it, by the same loss in torch (the mean over all
  B*T rows of -sum_v target * log_softmax(logits), masked rows counting 0, as its kernels compute).
- ``TargetHead`` reads the LM head through a ``*.index.json``, which a single-file checkpoint lacks:
  the target is presented as a folder of links to its files plus a generated index.
- The draft config SpecForge derives from the target fixes ``draft_vocab_size`` at 32,000; the same
  derivation (target architecture fields, one layer) is written with the bench's draft vocabulary.
  Its vocabulary map is its own (``process_token_dict_to_mappings`` over assistant-token counts), given
  the counts of the whole training set as every run gets them, not only the features' (the budget's).
- CPU: ``SPECFORGE_DEVICE=cpu``, ``training.fsdp_sharding=NO_SHARD``, ``attention_backend=sdpa``,
  ``dataloader_num_workers=0`` (so its CPU time is this process's); SmolLM2 ties its embeddings, so
  ``model.lm_head_key=model.embed_tokens.weight``. Everything else is SpecForge's default (AdamW
  lr 1e-4, cosine, warmup 1.5%, batch 1 conversation, one epoch), except ``ttt_length`` (the bench's TTT
  depth) and one evaluation on the held-out features at the end.
- Each batch's real tokens and padded positions are counted (a wrapper around its
  ``DataCollatorWithPadding.__call__``) for the steady rate: several conversations a step are padded to
  the longest.

``--draft dflash``: ``training.strategy=dflash`` on ``.ckpt`` records holding the three tapped states
concatenated as ``hidden_states`` (its DFlash trainer learns the data's own tokens: no final state, no
target logits, no vocabulary map; the target's embedding and LM head come from the target folder). The
draft config is SpecForge's own target-derived one (``resolve_draft_config``) with the bench's block size
8 (its default 16) and target layers [1, 14, 26] in ``dflash_config`` (its default for one draft layer is
the middle layer alone, [15]); its ``resolve_mask_token_id`` picks the mask token, written into that
config so the export records it. Exported with ``export --to hf`` (its sglang export refuses DFlash).
Otherwise its defaults: AdamW lr 1e-4, cosine, warmup 1.5%, one conversation a step, up to 512 anchors,
no position decay (``loss_decay_gamma`` unset), the ``dflash`` loss, bfloat16; ``attention_backend=sdpa``
instead of flex_attention, as for EAGLE-3. Its evaluation logs loss and accuracy (no accepted length).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
from driver import counted, driver_args, record_steps, set_dotted, write_result

os.environ.setdefault("SPECFORGE_DEVICE", "cpu")


def torch_log_softmax_loss() -> types.ModuleType:
    """A stand-in ``specforge.core.loss`` whose ``LogSoftmaxLoss.apply`` is the Triton kernels' loss in torch."""

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target, position_mask):
            logp = torch.log_softmax(logits.float(), dim=-1)
            per_row = (target.float() * logp).sum(-1) * position_mask.reshape(logits.shape[:2]).float()
            return -per_row.mean()

    module = types.ModuleType("specforge.core.loss")
    module.LogSoftmaxLoss = LogSoftmaxLoss
    return module


def count_step_tokens() -> tuple[list[int], list[int]]:
    """(real tokens, padded positions) of every batch SpecForge's collator pads, in order (training first):
    its batches of several conversations are padded to the longest."""
    from specforge.data.utils import DataCollatorWithPadding

    tokens: list[int] = []
    positions: list[int] = []
    DataCollatorWithPadding.__call__ = counted(DataCollatorWithPadding.__call__, tokens, positions)
    return tokens, positions


def evaluate_once_at_the_end(run: dict, conversations: int) -> None:
    """SpecForge evaluates every ``eval_interval`` optimizer steps: set it to the run's last step, one
    conversation a step unless ``training.batch_size`` (an override) takes several."""
    batch = int(run["training"].get("batch_size", 1))
    run["training"]["eval_interval"] = -(-conversations // batch)


def target_with_index(target: Path, folder: Path) -> Path:
    """The target's files linked into ``folder`` with a ``model.safetensors.index.json`` beside them."""
    from safetensors import safe_open

    folder.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        link = folder / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    weight_map = {}
    for shard in sorted(target.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            weight_map.update({key: shard.name for key in f.keys()})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def draft_config(target: Path, draft_vocab_size: int, path: Path) -> Path:
    """SpecForge's target-derived EAGLE-3 draft config, with the bench's draft vocabulary."""
    base = json.loads((target / "config.json").read_text())
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
              "rope_parameters", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "vocab_size")  # fmt: skip
    config = {k: base[k] for k in fields if base.get(k) is not None}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, use_cache=True, pad_token_id=base.get("pad_token_id") or 0,
                  draft_vocab_size=draft_vocab_size)  # fmt: skip
    path.write_text(json.dumps(config, indent=1))
    return path


def vocab_mapping(work: Path, budget: dict, target: Path, path: Path) -> Path:
    """SpecForge's own mapping (``process_token_dict_to_mappings``) from the whole training set's assistant tokens."""
    from collections import Counter

    from specforge.data.preprocessing import process_token_dict_to_mappings

    counts = json.loads((work / "data" / "vocab_counts.json").read_text())["assistant"]
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    d2t, t2d = process_token_dict_to_mappings(
        Counter({int(t): n for t, n in counts.items()}), budget["draft_vocab_size"], vocab_size
    )
    torch.save({"d2t": d2t, "t2d": t2d}, path)
    return path


def dflash_config(run: dict, budget: dict, path: Path) -> Path:
    """SpecForge's own target-derived DFlash draft config (``resolve_draft_config`` on the run as it stands),
    with the bench's block size and target layers, and the mask token its trainer resolves for this target
    (``resolve_mask_token_id``) written in, so the exported head records the token it was trained with."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.config.schema import Config
    from specforge.training.model_loading import resolve_draft_config
    from specforge.training.model_utils import resolve_mask_token_id
    from transformers import AutoTokenizer

    cfg = Config.model_validate(run)
    provider = builtin_algorithm_registry().resolve("dflash").providers.model.draft_config
    config = resolve_draft_config(cfg, provider=provider)
    config.block_size = budget["block_size"]
    config.num_hidden_layers = budget["num_layers"]
    config.layer_types = [config.layer_types[0]] * budget["num_layers"]
    tokenizer = AutoTokenizer.from_pretrained(run["model"]["target_model_path"])
    mask = resolve_mask_token_id(explicit=None, tokenizer=tokenizer, embedding_vocab_size=config.vocab_size)
    config.dflash_config = {"target_layer_ids": budget["capture_layers"], "mask_token_id": mask}
    config.to_json_file(str(path))
    return path


def main() -> int:
    args, budget = driver_args()
    sys.modules["specforge.core.loss"] = torch_log_softmax_loss()
    marks = record_steps()
    step_tokens, step_positions = count_step_tokens()

    target = target_with_index(Path(budget["target_path"]), args.out / "target")
    run = {
        "model": {"target_model_path": str(target), "lm_head_key": "model.embed_tokens.weight"},
        "data": {
            "hidden_states_path": str(args.work / "specforge" / "train"),
            "eval_hidden_states_path": str(args.work / "specforge" / "heldout"),
            "max_length": budget["max_length"],
            "dataloader_num_workers": 0,
            "cache_dir": str(args.out / "cache"),
        },
        "training": {
            "fsdp_sharding": "NO_SHARD",
            "attention_backend": "sdpa",
            "log_interval": 1,
        },
        "output_dir": str(args.out / "output"),
    }
    for key, value in args.override:  # SpecForge's own config keys (training.learning_rate=3e-4, ...);
        set_dotted(run, key, value)  # its schema forbids unknown ones, so a typo stops the run
    evaluate_once_at_the_end(run, len(list((args.work / "specforge" / "train").glob("*.ckpt"))))
    draft_json = args.out / "draft.json"
    if args.draft == "dflash":
        run["training"]["strategy"] = "dflash"
        run["model"]["draft_model_config"] = str(dflash_config(run, budget, draft_json))
    else:
        run["training"]["ttt_length"] = budget["ttt_steps"]
        run["model"]["draft_model_config"] = str(draft_config(target, budget["draft_vocab_size"], draft_json))
        run["model"]["vocab_mapping_path"] = str(
            vocab_mapping(args.work, budget, target, args.out / "vocab_mapping.pt")
        )
    config = args.out / "run.yaml"
    config.write_text(json.dumps(run, indent=1))  # JSON is YAML

    from specforge.cli import main as specforge
    from specforge.training import assembly

    logged: list[dict] = []  # what SpecForge logs with report_to=none (its console logger), kept as well
    console = assembly._logger
    assembly._logger = lambda metrics, step: (
        logged.append({"step": step, **metrics}),
        console(metrics, step),
    )
    code = specforge(["train", "-c", str(config)])
    if code:
        return code
    head = args.out / "head"
    checkpoint = args.out / "output" / "specforge-run-latest" / "training_state.pt"
    engine = "hf" if args.draft == "dflash" else "sglang"  # its export refuses DFlash --to sglang
    specforge(["export", "--to", engine, "--checkpoint", str(checkpoint),
               "--draft-config", str(draft_json), "--output-dir", str(head)])  # fmt: skip
    evals = [d for d in logged if any(k.startswith("eval/") for k in d)]
    heldout = (
        {k.removeprefix("eval/"): v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}
    )
    write_result(args.out, marks, head, heldout=heldout, steps=len(marks), step_tokens=step_tokens[: len(marks)],
                 step_positions=step_positions[: len(marks)])  # fmt: skip
    return 0


def _plain(value):
    """A logged metric as JSON: tensors and lists of them as floats."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return float(value)


if __name__ == "__main__":
    raise SystemExit(main())
