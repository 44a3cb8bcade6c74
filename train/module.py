"""The LightningModule of the one training loop: the draft being trained and its kind's objective.

The frozen target is kept outside the module (a plain attribute, not a submodule), so it is never in
the optimizer or in a checkpoint. Each step gets a ``Batch`` and its ``Teacher`` — from a target forward
(online) or the feature cache (offline) — and hands both to the draft kind's ``Objective``. Validation
reports loss and simulated acceptance (τ and per-position rates) on held-out conversations, and
exports the draft. How a run is put together around it is ``train/loop.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from functools import partial
from pathlib import Path

import lightning as L
import torch
import yaml

from draftsmith import files
from draftsmith.decode.features import final_norm
from draftsmith.decode.target import Target
from draftsmith.eval.stats import AcceptanceStats
from draftsmith.train.infra.checkpoint import (
    DRAFT_DIR,
    TRAIN_STATE,
    drop_frozen,
    export_draft,
    restore_frozen,
)
from draftsmith.train.infra.distributed import shard_draft, whole_draft
from draftsmith.train.objective import Batch, Objective, Teacher
from draftsmith.train.optimizers import build_optimizer
from draftsmith.train.schema import TrainConfig, to_dict
from draftsmith.train.teacher import compute_teacher, teacher_from_final_state


def acceptance_summary(histogram: torch.Tensor) -> dict[str, float]:
    """τ, α and per-position acceptance from a simulated histogram (entry j = positions where exactly j
    of k drafted tokens were accepted), derived by ``eval.stats.AcceptanceStats`` like every other report."""
    k = len(histogram) - 1
    counts = [round(float(c)) for c in histogram.cpu()]
    stats = AcceptanceStats(Counter({(k, a): n for a, n in enumerate(counts) if n}))
    if stats.num_steps == 0:
        return {"tau": 1.0, "alpha": 0.0}
    out = {"tau": stats.tau, "alpha": stats.alpha}
    out.update({f"acc_pos_{i + 1}": rate for i, rate in enumerate(stats.per_position)})
    return out


def lr_factor(step: int, warmup: int, max_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step``: linear warm-up, then constant, or a cosine or
    linear decay to ``min_ratio`` at ``max_steps``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(_to_device(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    return obj


class DraftModule(L.LightningModule):
    """The draft being trained plus its objective; the frozen target sits beside it, not inside."""

    def __init__(self, objective: Objective, config: TrainConfig, target: Target | None, output_dir: Path):
        super().__init__()
        self.objective = objective
        self.config = config
        self.target = target  # a plain object (not an nn.Module): never registered, saved or optimized
        self.output_dir = output_dir
        self.draft = objective.build_draft()
        self.val_history: list[dict[str, float]] = []
        self._val_hist: torch.Tensor | None = None

    def configure_model(self) -> None:
        """Where the strategy is FSDP2 (``trainer.strategy: fsdp`` on the CPU, ``distributed._cpu_fsdp``) it
        gives the module a device mesh, and the draft is sharded over it from outside (``shard_draft``)."""
        if self.device_mesh is not None:
            shard_draft(self.draft, self.device_mesh["data_parallel"])

    # ---- data on the device, teacher outputs

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return _to_device(batch, device)

    def on_fit_start(self) -> None:
        if self.target is not None and self._head_in_step:  # offline: the final norm and LM head run here
            final_norm(self.target.model).to(self.device)
            self.target.model.get_output_embeddings().to(self.device)
        if self.target is None or self.config.mode != "online":
            return
        if self.config.target.shard:  # each rank keeps 1/N of the target (train/infra/shard_target.py)
            self._shard_target()
            return
        placed = set(getattr(self.target.model, "hf_device_map", {}).values())
        if len(placed) <= 1:  # a target spread over several devices (device_map: auto) stays where it is
            self.target.model.to(self.device)

    on_validation_start = on_fit_start

    def _shard_target(self) -> None:
        from draftsmith.train.infra.shard_target import is_sharded, local_parameter_count, shard_frozen_target

        if is_sharded(self.target.model):
            return
        shard_frozen_target(self.target.model, self.device)
        local, total = local_parameter_count(self.target.model)
        print(
            f"[draftsmith] rank {self.global_rank}: target sharded over {self.trainer.world_size} ranks, "
            f"{local:,} of its {total:,} parameters here ({local / total:.0%})",
            flush=True,
        )

    def _with_teacher(self, batch) -> tuple[Batch, Teacher]:
        if isinstance(batch, Batch):  # online: one no-grad target forward
            obj = self.objective
            return batch, compute_teacher(self.target, batch, obj.capture_layers, obj.teacher_topk)
        batch, teacher = batch  # offline: read from the feature cache
        if self._head_in_step:  # a final_state cache: the teacher's top-k from its last layer, here
            obj = self.objective
            teacher = teacher_from_final_state(self.target, teacher, obj.capture_layers, obj.teacher_topk)
        return batch, teacher

    @property
    def _head_in_step(self) -> bool:
        """Whether each step computes the teacher's logits from a ``final_state`` cache (``cache.teacher``)."""
        return self.config.mode == "offline" and self.config.cache.teacher == "final_state"

    # ---- steps

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, Batch):  # online: the objective may swap in on-policy rows first
            batch = _to_device(self.objective.prepare_batch(self.draft, batch), self.device)
        batch, teacher = self._with_teacher(batch)
        out = self.objective.loss(self.draft, batch, teacher)
        size = int(batch.input_ids.shape[0])
        # the loss logged is the mean over all ranks: the same curve on any number of processes
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=size, sync_dist=True)
        for name, value in out.items():
            if name != "loss":  # counts (num_tokens) are logged as floats: Lightning averages what it logs
                self.log(f"train/{name}", torch.as_tensor(value, dtype=torch.float32), batch_size=size)
        return out["loss"]

    def on_validation_epoch_start(self) -> None:
        self._val_hist = torch.zeros(self.config.trainer.val_k + 1, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx: int) -> None:
        batch, teacher = self._with_teacher(batch)
        out = self.objective.loss(self.draft, batch, teacher)
        size = int(batch.input_ids.shape[0])
        for name, value in out.items():
            value = torch.as_tensor(value, dtype=torch.float32)
            self.log(f"val/{name}", value, batch_size=size, sync_dist=True, prog_bar=False)
        hist = self.objective.acceptance(self.draft, batch, teacher, self.config.trainer.val_k)
        self._val_hist += hist.to(self._val_hist)

    def on_validation_epoch_end(self) -> None:
        hist = self.trainer.strategy.reduce(self._val_hist, reduce_op="sum")
        summary = acceptance_summary(hist)
        self.log("val/tau", summary["tau"], prog_bar=True, sync_dist=False)
        for name, value in summary.items():
            if name != "tau":
                self.log(f"val/{name}", value, sync_dist=False)
        if self.trainer.sanity_checking:
            return
        record = {"step": int(self.global_step), **summary, "histogram": hist.cpu().tolist()}
        self.val_history.append(record)
        draft = whole_draft(self.draft, self.objective.build_draft)  # every rank: a sharded draft is gathered
        if self.trainer.is_global_zero:
            self.export(record, draft)

    def export(self, record: dict, draft: torch.nn.Module | None = None) -> Path:
        """Write the draft (save_pretrained) with the resolved config and its last validation, atomically."""
        extra = {
            "train_config.yaml": yaml.safe_dump(to_dict(self.config), sort_keys=False),
            TRAIN_STATE: files.json_text(record),
        }
        return export_draft(
            self.objective, self.draft if draft is None else draft, self.output_dir / DRAFT_DIR, extra
        )

    # ---- checkpoints: without the frozen copies of the target's weights (train/infra/checkpoint.py)

    def _frozen(self) -> dict[str, torch.Tensor]:
        return {f"draft.{name}": p for name, p in self.draft.named_parameters() if not p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        drop_frozen(checkpoint, self._frozen(), self.config.target.spec)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        restore_frozen(checkpoint, self._frozen(), self.config.target.spec, self.trainer.ckpt_path)

    # ---- optimisation

    def configure_optimizers(self):
        o = self.config.optim
        trainable = [(n, p) for n, p in self.draft.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(
                f"the {self.objective.kind} draft has no trainable parameters (all requires_grad=False)"
            )
        optimizer = build_optimizer(self.draft, trainable, o)
        schedule = partial(
            lr_factor,
            warmup=o.warmup_steps,
            max_steps=self.config.trainer.max_steps,
            schedule=o.schedule,
            min_ratio=o.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
