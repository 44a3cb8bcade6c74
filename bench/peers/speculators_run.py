"""speculators 0.9.0's EAGLE-3 training (``speculators train``), its checkpoint being vLLM's native format.

Run by bench/peer_training.py with the speculators venv's python. Where this departs from
speculators' own pipeline, and why:

- Features: speculators reads hidden states that vLLM wrote (``hs_{i}.safetensors``: the three
  captured states and the last layer's, before the final norm); vLLM does not run here, so
  bench/peer_training.py's capture stage wrote that layout from transformers (bfloat16, its
  default ``--hidden-states-dtype``), with the preprocessed dataset (``input_ids``, ``loss_mask``,
  ``seq_len``) and ``token_freq.pt`` beside it. The held-out conversations follow the training ones
  in that dataset and ``--train-data-ratio`` splits exactly there, so its validation is the bench's
  held-out set.
- Three launch-time patches to ``speculators/train/trainer.py``'s Trainer, which assumes CUDA, made
  here by monkeypatching (the installed package is not edited): the module's ``get_local_rank``
  returns ``"cpu"`` (its ``.to(local_rank)`` means cuda:0), ``device_type`` reads ``"cpu"`` (it falls
  back to ``"cuda"`` for autocast when no accelerator is present), and ``torch.accelerator.synchronize``
  is a no-op without an accelerator (the step timer calls it unconditionally).
- CPU flags: ``--loss-implementation eager --draft-attn-impl sdpa --num-workers 0`` (the fused loss
  and flex attention need a GPU; no workers so its CPU time is this process's).
- Its packed steps hold different numbers of tokens, so the collator's output is counted per step
  (a wrapper around ``CollateFn.__call__``: real tokens and positions) for the steady-state rate.
- One epoch (its default is 20) so it trains on the bench's token budget; the bench's draft
  vocabulary and TTT depth. Everything else is speculators' default: Muon with AdamW for the rest,
  lr 1e-3, linear schedule, conversations packed into 8,192-token steps, its EAGLE-3 variant
  (norm before fc and residual, normed outputs across TTT steps), target layers [2, n/2, n-3] in
  vLLM's convention (the outputs of layers 1, n/2-1, n-4, as the capture wrote them).

``--draft dflash``: ``--speculator-type dflash`` on the same dataset (its DFlash reads the three tapped
states and, for its soft targets, the last layer's state through the verifier's norm and LM head, as the
capture wrote them). The bench's shape: one layer (its default 5) and block size 8 (its default 16),
target layers [2, 15, 27] in vLLM's convention, its default on this target too (draftsmith's taps
[1, 14, 26] + 1). ``--full-attention-indices 0``: its default makes every draft layer sliding-window
attention, causal inside a block; vLLM's ``DFlashDraftModel`` and draftsmith's decoder attend
non-causally inside a block (vLLM: ``layer_types`` full_attention), so the head is trained as it is
served. No ``--draft-vocab-size``: its default, the verifier's full vocabulary (so is every run's).
Otherwise its defaults: D-PACE position weights, cross-entropy on the verifier's distribution, up to 512
anchors per step, Muon + AdamW at lr 1e-3, linear schedule, 8,192-token packed steps. Its validation logs
``eal`` (expected accepted length per block) on the held-out conversations.
"""

from __future__ import annotations

import json
import shutil
import sys

import torch
from driver import driver_args, record_steps, write_result


def patch_trainer_for_cpu() -> None:
    """The three launch-time patches (see the module docstring), applied to the imported classes."""
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    trainer.Trainer.device_type = property(lambda self: "cpu", lambda self, value: None)
    synchronize = torch.accelerator.synchronize
    torch.accelerator.synchronize = lambda *a, **k: (
        synchronize(*a, **k) if torch.accelerator.is_available() else None
    )


def count_step_tokens() -> tuple[list[int], list[int]]:
    """(real tokens, positions) of every batch speculators' collator packs, in order (training first)."""
    from speculators.train import data

    counts: list[int] = []
    positions: list[int] = []
    collate = data.CollateFn.__call__

    def counting(self, batch):
        out = collate(self, batch)
        counts.append(int((out["document_ids"] >= 0).sum()))
        positions.append(out["document_ids"].numel())
        return out

    data.CollateFn.__call__ = counting
    return counts, positions


def main() -> int:
    args, budget = driver_args()
    data = args.work / "speculators"
    split = json.loads((data / "split.json").read_text())
    patch_trainer_for_cpu()
    marks = record_steps()
    step_tokens, step_positions = count_step_tokens()
    save = args.out / "checkpoints"
    shutil.rmtree(save, ignore_errors=True)  # a fresh run, as every run of the bench is
    if args.draft == "dflash":
        shape = ["--speculator-type", "dflash", "--block-size", str(budget["block_size"]),
                 "--target-layer-ids", *(str(i + 1) for i in budget["capture_layers"]),
                 "--full-attention-indices", "0"]  # fmt: skip
    else:
        shape = ["--speculator-type", "eagle3", "--draft-vocab-size", str(budget["draft_vocab_size"]),
                 "--ttt-steps", str(budget["ttt_steps"])]  # fmt: skip
    argv = [*shape, "--verifier-name-or-path", budget["target_path"],
            "--data-path", str(data), "--on-missing", "raise",
            "--train-data-ratio", str((split["train"] + 0.5) / (split["train"] + split["heldout"])),
            "--num-layers", str(budget["num_layers"]), "--epochs", "1",
            "--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "0",
            "--save-path", str(save), "--no-resume-from-checkpoint", "--log-dir", str(args.out / "logs"),
            *(arg for k, v in args.override for arg in (f"--{k}", v))]  # its own flags (lr=3e-4), last wins  # fmt: skip
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    sys.argv = ["speculators train", *argv]
    speculators_train(TrainConfig.resolve())
    head = max((p for p in save.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))  # the last epoch's
    heldout = json.loads(
        (head / "val_metrics.json").read_text()
    )  # its validation: the held-out conversations
    write_result(args.out, marks, head, heldout=heldout, steps=len(marks), step_tokens=step_tokens[: len(marks)],
                 step_positions=step_positions[: len(marks)])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
