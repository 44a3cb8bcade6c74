"""DistillSpec-style distillation of a small causal-LM draft (``draft.kind: distill``).

The draft is an ordinary causal LM on the target's tokenizer (``drafts/distill.py``), trained to
match the target's next-token distribution with one of the divergences of ``train/losses.py``.
Alignment: the draft's and the teacher's logits at position t both predict token t + 1, so
position t is learnt when token t + 1 is a real assistant token (``next_token_mask``).

Options (``draft.options``): ``DistillOptions``, each field's docstring its help (``train --help``).

On-policy data (DistillSpec): ``mix_on_policy`` replaces a fraction of a batch's rows with the
draft's own continuations of their prompts, for the loop to score with the target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass
from torch import nn

from draftsmith.decode.target import Target
from draftsmith.drafts import distill
from draftsmith.loading import resolve_dtype
from draftsmith.train.losses import LOSSES, TokenLoss, distillation_loss, teacher_labels, token_count
from draftsmith.train.objective import Batch, Objective, Teacher
from draftsmith.train.objectives.on_policy import mix_on_policy
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION


@dataclass(config=SECTION)
class DistillOptions:
    """``draft.options`` of ``distill`` (see the module docstring)."""

    init: Literal["target_layers", "config", "pretrained"] = "target_layers"
    """How the draft starts: copies of target layers (layer_ids, or num_layers evenly spaced), a fresh model of
    the target's architecture (num_layers, hidden_size, intermediate_size), or a model loaded from path."""
    num_layers: Annotated[int, Field(ge=1)] = 2
    """Decoder layers of the draft (init target_layers without layer_ids, or config)."""
    layer_ids: list[int] | None = None
    """init target_layers: which target layers to copy (null = num_layers evenly spaced, first and last)."""
    hidden_size: Annotated[int, Field(ge=1)] | None = None
    """init config: hidden size (null = the target's)."""
    intermediate_size: Annotated[int, Field(ge=1)] | None = None
    """init config: MLP width (null = the target's)."""
    path: str | None = None
    """init pretrained: a model directory or Hub id on the target's tokenizer."""
    loss: Literal[tuple(LOSSES)] = "fkl"
    """The divergence: fkl, rkl, jsd (with beta), tvd, or ce on the teacher's greedy tokens (or the data's,
    ce_labels: data)."""
    beta: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """jsd's mixture weight."""
    temperature: Annotated[float, Field(gt=0.0)] = 1.0
    """Softens both distributions."""
    teacher_topk: Annotated[int, Field(ge=0)] = 0
    """0 = the teacher's full logits, else the loss sees only its top-k (train/losses.py)."""
    ce_labels: Literal["teacher", "data"] = "teacher"
    """What loss: ce is scored against: the teacher's greedy tokens or the data's."""
    lora: dict[str, Any] | None = None
    """Train a LoRA adapter instead of every weight: {r, alpha, dropout, target_modules} (null = none)."""
    merge_lora: bool = True
    """Merge the adapter into the weights on save."""
    dtype: str = "float32"
    """The draft's training dtype."""
    seed: int = 0
    """Seed of a fresh init (init config) and of the on-policy samples."""
    on_policy_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """The share of each training batch replaced by the draft's own continuations of the batch's prompts,
    scored by the target (DistillSpec's on-policy data; 0 = fixed data only)."""
    on_policy_max_new_tokens: Annotated[int, Field(ge=1)] = 64
    """Tokens the draft samples per on-policy continuation."""
    on_policy_temperature: Annotated[float, Field(ge=0.0)] = 1.0
    """Sampling temperature of the on-policy continuations (0 = greedy)."""


def next_token_mask(batch: Batch) -> torch.Tensor:
    """[B, T - 1] bool: position t is learnt when token t + 1 is a real assistant token."""
    return (batch.loss_mask[:, 1:] > 0) & (batch.attention_mask[:, 1:] > 0)


def evenly_spaced(num_layers: int, total: int) -> list[int]:
    """``num_layers`` layer ids spread over 0..total-1, first and last included."""
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers} must be within 1..{total} (the target's layer count)")
    if num_layers == 1:
        return [total - 1]
    return sorted({round(i * (total - 1) / (num_layers - 1)) for i in range(num_layers)})


def chain_run_lengths(agree: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T]: the run of consecutive agreements from each position t (capped at k; 0 where invalid).

    ``agree`` / ``valid`` [B, T]. A run stops at the first disagreement, invalid position or row end.
    """
    ok = agree.bool() & valid.bool()
    run = ok.clone()
    lengths = torch.zeros(ok.shape, dtype=torch.long, device=ok.device)
    for j in range(k):
        if j > 0:
            ahead = torch.zeros_like(ok)
            ahead[:, : ok.shape[1] - j] = ok[:, j:]
            run = run & ahead
        lengths += run.long()
    return lengths


class DistillObjective(Objective):
    """A small causal LM distilled from the target's next-token distributions."""

    kind = distill.DISTILL
    capture_layers = ()

    def __init__(self, target: Target, options: DistillOptions | None = None):
        """``options``: ``draft.options`` as its record, ``DistillOptions`` (each option's default, range and
        meaning, as ``train --help`` shows them)."""
        opts = DistillOptions() if options is None else options
        if opts.init == "pretrained" and not opts.path:
            raise ValueError("distill option init='pretrained' needs path: a model directory or Hub id")
        topk = int(opts.teacher_topk)
        self.target = target
        self.options = opts
        self.teacher_topk = target.vocab_size if topk == 0 else min(topk, target.vocab_size)
        self.merge_lora = bool(opts.merge_lora)
        self.reads_target_layers = opts.init == "target_layers"
        self.generator: torch.Generator | None = None  # made on the draft's device at first use

    @property
    def on_policy(self) -> bool:
        return float(self.options.on_policy_fraction) > 0

    def state_dict(self) -> dict:
        """The on-policy sampling generator, so a resumed run draws the same continuations."""
        if self.generator is None:
            return {}
        return {"generator": self.generator.get_state(), "device": str(self.generator.device)}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self.generator = torch.Generator(device=state["device"])
            self.generator.set_state(state["generator"])

    def prepare_batch(self, draft: nn.Module, batch: Batch) -> Batch:
        """Replace ``on_policy_fraction`` of the rows by the draft's continuations (before the teacher runs)."""
        if not self.on_policy:
            return batch
        device = next(draft.parameters()).device
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(int(self.options.seed))
        was_training = draft.training
        draft.eval()
        mixed = mix_on_policy(
            batch, draft, self.target, float(self.options.on_policy_fraction),
            int(self.options.on_policy_max_new_tokens), float(self.options.on_policy_temperature),
            self.generator,
        )  # fmt: skip
        draft.train(was_training)
        return mixed

    def build_draft(self) -> nn.Module:
        o, target = self.options, self.target
        dtype = resolve_dtype(o.dtype)
        if o.init == "config":
            model = distill.from_config(
                target,
                int(o.num_layers),
                o.hidden_size,
                o.intermediate_size,
                dtype=dtype,
                seed=o.seed,
            )
        elif o.init == "target_layers":
            total = int(target.config.num_hidden_layers)
            ids = o.layer_ids if o.layer_ids is not None else evenly_spaced(int(o.num_layers), total)
            model = distill.from_target_layers(target, [int(i) for i in ids], dtype=dtype)
        else:
            model = distill.from_pretrained_draft(str(o.path), target, dtype=dtype)
        if o.lora is not None:
            model = distill.apply_lora(model, **dict(o.lora))
        return model

    def _teacher(self, teacher: Teacher) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher logits for positions 0..T-2 and ids (None when they are the full vocabulary)."""
        if teacher.topk_logits is None or teacher.topk_ids is None:
            raise ValueError("the distill objective needs Teacher.topk_logits/topk_ids (teacher_topk > 0)")
        values, ids = teacher.topk_logits[:, :-1], teacher.topk_ids[:, :-1]
        if values.shape[-1] == self.target.vocab_size:  # all logits: put them back in vocabulary order
            return values.new_empty(values.shape).scatter_(-1, ids.long(), values), None
        return values, ids

    def _draft_logits(self, draft: nn.Module, batch: Batch) -> torch.Tensor:
        device = next(draft.parameters()).device
        if getattr(batch, "position_ids", None) is not None:
            # packed rows: position_ids without a 2-D mask (and without a cache) make transformers
            # mask block-diagonally
            extra = {"position_ids": batch.position_ids.to(device), "use_cache": False}
        else:
            extra = {"attention_mask": batch.attention_mask.to(device)}
        out = draft(input_ids=batch.input_ids.to(device), **extra)
        return out.logits[:, :-1]

    def loss(
        self, draft: nn.Module, batch: Batch, teacher: Teacher, num_tokens: float | None = None
    ) -> dict[str, torch.Tensor]:
        """``loss`` = Σ per-token loss / ``num_tokens`` (default: this batch's own token count).

        For exact gradient accumulation pass ``num_tokens`` = the token count of the whole
        optimiser step (Σ of ``num_loss_tokens`` over its micro-batches), or backpropagate
        ``loss_sum / N`` yourself (``loss_sum`` is differentiable; ``num_tokens`` is this batch's count).
        """
        o = self.options
        logits = self._draft_logits(draft, batch)
        mask = next_token_mask(batch).to(logits.device)
        t_logits, t_ids = self._teacher(teacher)
        t_logits, t_ids = t_logits.to(logits.device), None if t_ids is None else t_ids.to(logits.device)
        greedy = teacher_labels(t_logits, t_ids)
        labels = batch.input_ids[:, 1:].to(logits.device) if o.ce_labels == "data" else greedy
        temperature, beta = float(o.temperature), float(o.beta)
        result: TokenLoss = distillation_loss(
            o.loss,
            logits,
            t_logits,
            mask,
            teacher_ids=t_ids,
            temperature=temperature,
            beta=beta,
            labels=labels,
        )
        with torch.no_grad():
            agree = (logits.argmax(-1) == greedy)[mask].float()
            agreement = agree.mean() if agree.numel() else agree.new_zeros(())
        return {
            "loss": result.mean(num_tokens),
            "loss_sum": result.total,
            "num_tokens": result.count,
            "top1_agreement": agreement,
        }

    @staticmethod
    def num_loss_tokens(batch: Batch) -> int:
        """How many positions ``loss`` sums over for this batch (add these up for ``num_tokens``)."""
        return int(token_count(next_token_mask(batch)))

    @torch.no_grad()
    def chain_lengths(
        self, draft: nn.Module, batch: Batch, teacher: Teacher, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B, T - 1], starts [B, T - 1]) for ``decoding_walk``: the run of agreements from
        each position, and where decoding starts chains (once the target has produced token t itself).

        Approximation: one teacher-forced pass. At each valid position the draft's greedy token is
        compared with the teacher's; the accepted length from position t is the run of consecutive
        agreements t, t+1, ... (capped at k). Real chain drafting conditions depth j on the draft's
        own earlier tokens, which equal the data only when the data is the target's own greedy
        output; on other data this estimates acceptance on the data's path, not the target's.
        """
        logits = self._draft_logits(draft, batch)
        mask = next_token_mask(batch).to(logits.device)
        t_logits, t_ids = self._teacher(teacher)
        greedy = teacher_labels(
            t_logits.to(logits.device), None if t_ids is None else t_ids.to(logits.device)
        )
        starts = mask & (batch.loss_mask[:, :-1] > 0).to(mask.device)
        return chain_run_lengths(logits.argmax(-1) == greedy, mask, k), starts

    def save(self, draft: nn.Module, directory: Path) -> None:
        """A plain causal-LM directory (loads as a ``distill`` draft) recording its target."""
        distill.save_draft(draft, self.target.tokenizer, self.target, directory, merge=self.merge_lora)


@register_objective(distill.DISTILL, options=DistillOptions)
def _build_objective(target: Target, options: dict[str, Any], token_counts=None) -> DistillObjective:
    return DistillObjective(target, DistillOptions(**options))
