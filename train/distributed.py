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

from draftsmith import files
from draftsmith.train.schema import TrainConfig, TrainerConfig

DEEPSPEED_INSTALL = "pip install 'draftsmith[deepspeed]'"


def env_rank(num_nodes: int | None = None) -> tuple[int, int, int]:
    """(global rank, local rank, world size) from the launcher's environment (torchrun, SLURM, Lightning).

    Known before any process group exists, so the target can be loaded onto the right device and
    the offline cache split across ranks before training starts. (0, 0, 1) when not launched: then
    ``planned_rank`` says what this process will be once Lightning's launcher starts the others.
    ``num_nodes`` gives the processes per node where Lightning's launcher leaves them unsaid.
    """
    return _launched_rank(num_nodes) or (0, 0, 1)


def _launched_rank(num_nodes: int | None) -> tuple[int, int, int] | None:
    env = os.environ
    if "WORLD_SIZE" in env and ("RANK" in env or "LOCAL_RANK" in env):  # torchrun, Lightning's launcher
        local, world = int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
        if "RANK" in env:
            return int(env["RANK"]), local, world
        if "LOCAL_WORLD_SIZE" in env:
            per_node = int(env["LOCAL_WORLD_SIZE"])
        else:  # Lightning's launcher: WORLD_SIZE is its processes per node x num_nodes
            per_node = world // num_nodes if num_nodes else torch.cuda.device_count() or 1
        return _node_rank() * per_node + local, local, world
    if (
        "SLURM_PROCID" in env
        and "SLURM_NTASKS" in env
        and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    ):
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return None


def _node_rank() -> int:
    """This node's index as Lightning's own environment reads it (set by the user on each node)."""
    return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))


def devices_per_node(t: TrainerConfig) -> int:
    """How many processes Lightning runs on each node for ``trainer.devices``: an int, ``"auto"``/-1 (every
    visible GPU, or 1 on the CPU), a count as a string, or a list of device ids (``"[0, 1]"``, ``"0,1"``)."""
    devices = t.devices
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            devices = -1
        elif "," in text or text.startswith("["):
            return max(1, len([d for d in text.strip("[]").split(",") if d.strip()]))
        else:
            try:
                devices = int(text)
            except ValueError:
                raise ValueError(
                    f"trainer.devices={t.devices!r} is not a device count, a list of device ids or auto; "
                    "write e.g. 8, '[0, 1]' or auto"
                ) from None
    if devices == -1:
        return (torch.cuda.device_count() or 1) if trainer_device_type(t) == "cuda" else 1
    return max(1, devices)


def planned_rank(t: TrainerConfig) -> tuple[int, int, int]:
    """(global rank, local rank, world size) this process trains as, the same before and after
    ``trainer.fit``: the launcher's when it started every rank (torchrun, SLURM, a rank Lightning started);
    else what Lightning's own launcher will make of this process, the first of its node (``NODE_RANK``),
    in a world of ``trainer.devices`` x ``trainer.num_nodes`` processes. Every strategy draftsmith accepts
    runs one process per device, so that product is the world size whatever the strategy."""
    launched = _launched_rank(t.num_nodes)
    if launched is not None:
        return launched
    per_node = devices_per_node(t)
    return _node_rank() * per_node, 0, per_node * t.num_nodes


def capture_rank(t: TrainerConfig) -> tuple[int, int]:
    """(index, count) of this process among those that fill the offline feature cache before training.

    A launcher that started every rank (torchrun, SLURM) lets all of them capture, rank r its shards. Under
    Lightning's own launcher only each node's first process exists before ``trainer.fit``; the others are
    started by fit, after the capture, so a shard left to them would be waited for forever. There the
    nodes' first processes (all started by the user) capture every shard between them, node n the shards
    ``i % num_nodes == n``, and the ranks fit starts find the cache complete.
    """
    launched = _launched_rank(t.num_nodes)
    if launched is not None:
        return launched[0], launched[2]
    return _node_rank(), t.num_nodes


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
            files.sync_tree(tmp)  # each rank what it sees (its own shards on a node's disk): on disk first
            self.barrier("atomic_deepspeed_post")
            if self.is_global_zero:
                old = path.with_name(f".{path.name}.old")
                if path.exists():
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(path, old)
                os.replace(tmp, path)
                files.fsync_path(path.parent)
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
