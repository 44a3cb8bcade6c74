"""Strategies, launch environment and per-rank devices: all the distributed code, outside the model.

``build_strategy`` turns ``trainer.strategy`` into what ``lightning.Trainer(strategy=...)`` takes:
DDP as Lightning has it, FSDP with each decoder layer of the draft as a shard unit and full
(single-file) checkpoints, DeepSpeed ZeRO-2/3 through Lightning with checkpoints made atomic. The
frozen target is never part of the strategy's module: each rank holds it in its own dtype
(bf16 for large targets), loaded straight onto the rank's device (see ``target_device``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.train.schema import TrainConfig, TrainerConfig

DEEPSPEED_INSTALL = "pip install 'draftsmith[deepspeed]'"


def env_rank() -> tuple[int, int, int]:
    """(global rank, local rank, world size) from the launcher's environment (torchrun, SLURM, Lightning).

    Known before any process group exists, so the target can be loaded onto the right device and
    the offline cache split across ranks before training starts. (0, 0, 1) when not launched.
    """
    env = os.environ
    if "WORLD_SIZE" in env and ("RANK" in env or "LOCAL_RANK" in env):  # torchrun, Lightning's launcher
        local = int(env.get("LOCAL_RANK", 0))
        if "RANK" in env:
            return int(env["RANK"]), local, int(env["WORLD_SIZE"])
        per_node = int(env.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1))
        return int(env.get("NODE_RANK", 0)) * per_node + local, local, int(env["WORLD_SIZE"])
    if (
        "SLURM_PROCID" in env
        and "SLURM_NTASKS" in env
        and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    ):
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return 0, 0, 1


def target_device(device: str) -> str:
    """The device this rank loads the frozen target on: ``auto`` means this rank's own GPU."""
    if device != "auto" or not torch.cuda.is_available():
        return device
    return f"cuda:{env_rank()[1]}"


def trainer_device_type(t: TrainerConfig) -> str:
    """``cuda`` when the trainer will run on GPUs (its accelerator allows them and one is visible), else ``cpu``."""
    wants_gpu = t.accelerator in ("auto", "gpu", "cuda")
    return "cuda" if wants_gpu and torch.cuda.is_available() else "cpu"


def resolve_auto_precision(config: TrainConfig) -> TrainConfig:
    """``trainer.precision: auto`` and ``target.dtype: auto`` made concrete for this machine.

    Where bfloat16 matrix products are fast (``bf16_is_fast``: a GPU with bf16, or a CPU with AMX or
    AVX512-BF16), the draft trains in bf16-mixed (float32 master weights) and the frozen target runs in
    bfloat16; elsewhere both stay float32. The resolved values are what the run's config.yaml records.
    """
    from draftsmith.loading import bf16_is_fast, resolve_device

    t, tc = config.trainer, config.target
    if t.precision == "auto":
        fast = bf16_is_fast(trainer_device_type(t))
        t = dataclasses.replace(t, precision="bf16-mixed" if fast else "32-true")
    if tc.dtype == "auto":
        fast = bf16_is_fast(resolve_device(target_device(tc.device)))
        tc = dataclasses.replace(tc, dtype="bfloat16" if fast else "float32")
    return dataclasses.replace(config, trainer=t, target=tc)


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _decoder_layer_classes(module: nn.Module) -> set[type[nn.Module]]:
    """Classes of a draft's repeated blocks (``*DecoderLayer`` in transformers models, EAGLE heads)."""
    return {type(m) for m in module.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))}


def _wrap_decoder_layers(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """FSDP auto-wrap policy: every decoder layer is its own shard unit (the rest joins the root)."""
    return recurse or type(module).__name__.endswith(("DecoderLayer", "Block"))


def check_strategy(t: TrainerConfig) -> None:
    """Fail before any work when the strategy needs a package that is not installed."""
    if t.strategy.startswith("deepspeed") and not deepspeed_available():
        raise ImportError(
            f"trainer.strategy={t.strategy!r} needs DeepSpeed, which is not installed; install the optional "
            f"extra: {DEEPSPEED_INSTALL} (or choose trainer.strategy: ddp or fsdp)"
        )


def build_strategy(t: TrainerConfig) -> Any:
    """The Lightning strategy for ``trainer.strategy`` (a name Lightning resolves, or a strategy object)."""
    check_strategy(t)
    name = t.strategy
    if name.startswith("deepspeed"):
        return _atomic_deepspeed(name)
    if name in ("fsdp", "fsdp_cpu_offload"):
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(
            sharding_strategy="FULL_SHARD",
            state_dict_type="full",  # one checkpoint file: resumable on another world size, atomic
            auto_wrap_policy=_wrap_decoder_layers,
            cpu_offload=name == "fsdp_cpu_offload",
            use_orig_params=True,  # frozen and trainable parameters may share a shard unit
        )
    return name


def _atomic_deepspeed(name: str):
    """Lightning's DeepSpeed strategy for a registry name, writing its checkpoint directory atomically."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    class AtomicDeepSpeedStrategy(DeepSpeedStrategy):
        """DeepSpeed writes a checkpoint as a directory from every rank; write it under a temporary
        name and let rank 0 rename it into place once all ranks are done."""

        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            path = Path(filepath)
            tmp = path.with_name(f".{path.name}.tmp")
            if self.is_global_zero and tmp.exists():
                shutil.rmtree(tmp)
            self.barrier("atomic_deepspeed_pre")
            super().save_checkpoint(checkpoint, tmp, storage_options)
            self.barrier("atomic_deepspeed_post")
            if self.is_global_zero:
                old = path.with_name(f".{path.name}.old")
                if path.exists():
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            self.barrier("atomic_deepspeed_done")

    entry = StrategyRegistry[name]
    return AtomicDeepSpeedStrategy(**entry["init_params"])


def enable_activation_checkpointing(draft: nn.Module, kind: str) -> None:
    """Recompute the draft's activations in the backward pass (less memory, ~30% more compute)."""
    if getattr(draft, "supports_gradient_checkpointing", False) and hasattr(
        draft, "gradient_checkpointing_enable"
    ):
        draft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    layers = _decoder_layer_classes(draft)
    if not layers:
        raise ValueError(
            f"trainer.activation_checkpointing: the {kind} draft ({type(draft).__name__}) has no decoder layers "
            "to checkpoint and no gradient_checkpointing_enable(); set trainer.activation_checkpointing: false"
        )
    from torch.utils.checkpoint import checkpoint

    for module in draft.modules():
        if type(module) in layers:
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
