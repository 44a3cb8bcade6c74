"""Strategies, launch environment and per-rank devices: all the distributed code, outside the model.

``build_strategy`` turns ``trainer.strategy`` into what ``lightning.Trainer(strategy=...)`` takes:
DDP as Lightning has it, FSDP with each decoder layer of the draft as a shard unit and full
(single-file) checkpoints, DeepSpeed ZeRO-2/3 through Lightning with checkpoints made atomic. The
frozen target is never part of the strategy's module: each rank holds it in its own dtype
(bf16 for large targets), loaded straight onto the rank's device (see ``target_device``).
"""

from __future__ import annotations

import argparse
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
    """The Lightning strategy for ``trainer.strategy`` (a name Lightning resolves, or a strategy object).

    On the CPU, FSDP and DeepSpeed run over gloo although Lightning refuses them there (see
    ``_cpu_fsdp`` and ``_atomic_deepspeed``): both engines train on CPUs, and the suite runs them so.
    """
    check_strategy(t)
    name = t.strategy
    on_cpu = (
        t.accelerator in ("cpu", "auto") and trainer_device_type(t) == "cpu"
    )  # gpu without one: Lightning says so
    if name.startswith("deepspeed"):
        return _atomic_deepspeed(name, on_cpu)
    if name in ("fsdp", "fsdp_cpu_offload"):
        if on_cpu:
            return _cpu_fsdp(planned_rank(t)[2])
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(
            sharding_strategy="FULL_SHARD",
            state_dict_type="full",  # one checkpoint file: resumable on another world size, atomic
            auto_wrap_policy=_wrap_decoder_layers,
            cpu_offload=name == "fsdp_cpu_offload",
            use_orig_params=True,  # frozen and trainable parameters may share a shard unit
        )
    return name


def _cpu_fsdp(world_size: int):
    """FSDP of the draft on CPU processes: torch's FSDP2 (``fully_shard``, ``shard_draft``) under Lightning's
    ``ModelParallelStrategy``, all ranks one data-parallel dimension, checkpoints gathered into one file.

    Lightning's ``FSDPStrategy`` (FSDP1) cannot run there: Lightning's accelerator connector refuses it
    unless the accelerator is cuda or gpu (``lightning/pytorch/trainer/connectors/accelerator_connector.py``,
    ``_check_strategy_and_fallback``, 2.6: "The strategy `fsdp` requires a GPU accelerator"), and past that
    torch's FSDP1 refuses a CPU-only module (``torch/distributed/fsdp/_init_utils.py``,
    ``_init_device_handle``: "FSDP needs a non-CPU accelerator device"). FSDP2 shards on a CPU device mesh
    over gloo, and ``ModelParallelStrategy`` asks the module to shard itself in ``configure_model``
    (``DraftModule.configure_model`` calls ``shard_draft``).
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(
        data_parallel_size=world_size,
        tensor_parallel_size=1,
        save_distributed_checkpoint=False,  # one file, gathered on rank 0: resumable on another world size
    )


def whole_draft(draft: nn.Module, build) -> nn.Module | None:
    """The draft with whole weights, for export: ``draft`` itself unless FSDP2 sharded it; then, on rank 0, a
    fresh one from ``build()`` holding the gathered weights (None on the other ranks). Every rank calls it:
    gathering a sharded draft is a collective."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(draft, FSDPModule):
        return draft
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(draft, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    whole = build()
    whole.load_state_dict(state)
    return whole


def shard_draft(draft: nn.Module, mesh) -> nn.Module:
    """FSDP2 on the draft, in place: each decoder layer its own unit (gathered for its forward and
    backward, freed after), then the root (embeddings, fusion, head). Calling it again does nothing."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(draft, FSDPModule):
        return draft
    for module in list(draft.modules()):
        if type(module).__name__.endswith(("DecoderLayer", "Block")):
            fully_shard(module, mesh=mesh)
    fully_shard(draft, mesh=mesh)
    return draft


def _atomic_deepspeed(name: str, on_cpu: bool = False):
    """Lightning's DeepSpeed strategy for a registry name, writing its checkpoint directory atomically.

    ``on_cpu``: DeepSpeed's CPU accelerator over gloo (DeepSpeed 0.14.1 and later). Lightning's strategy
    refuses every accelerator but CUDA in ``setup_environment`` ("The DeepSpeed strategy is only supported
    on CUDA GPUs", ``lightning/pytorch/strategies/deepspeed.py``, 2.6), its ``setup_distributed`` checks
    that device indices equal local ranks, which CPU devices (no index) cannot, and it hands DeepSpeed the
    device index as ``device_rank`` (None on the CPU, where DeepSpeed's engine wants -1). Those three are
    overridden here, and DeepSpeed is told to use its CPU accelerator (``DS_ACCELERATOR=cpu``).
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry

    if on_cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"  # read once, when deepspeed.accelerator first resolves

    class AtomicDeepSpeedStrategy(DeepSpeedStrategy):
        """DeepSpeed writes a checkpoint as a directory from every rank; write it under a temporary
        name and let rank 0 rename it into place once all ranks are done."""

        def setup_environment(self) -> None:
            if not on_cpu:
                return super().setup_environment()
            _use_deepspeed_cpu_accelerator()
            DDPStrategy.setup_environment(self)  # what DeepSpeedStrategy's does, less its CUDA check

        def setup_distributed(self) -> None:
            if not on_cpu:
                return super().setup_distributed()
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()  # gloo: Lightning's backend for a CPU root device

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            if not on_cpu:
                return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
            import deepspeed

            engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=-1),  # Lightning passes the device index: None on the CPU
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return engine, deepspeed_optimizer

        def _initialize_deepspeed_inference(self, model) -> None:
            if not on_cpu:
                return super()._initialize_deepspeed_inference(model)
            import deepspeed
            from lightning.pytorch.strategies.deepspeed import remove_module_hooks

            config = {"train_micro_batch_size_per_gpu": 1}  # as Lightning's, with device_rank=-1 (ZeRO-1/2)
            config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
            remove_module_hooks(model)
            args = argparse.Namespace(device_rank=-1)
            self.model = deepspeed.initialize(args=args, config=config, model=model, optimizer=None,
                                              lr_scheduler=None, model_parameters=[], dist_init_required=False)[0]  # fmt: skip

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


def _use_deepspeed_cpu_accelerator() -> None:
    """Make DeepSpeed's accelerator its CPU one, also where it resolved to a GPU before ``DS_ACCELERATOR``
    was set (a process that imported deepspeed earlier on a GPU machine), with no op compiled at start.

    ``deepspeed.init_distributed`` on the CPU compiles its shared-memory all-reduce (a C++ extension,
    minutes of g++ on a small machine, built by every rank at once into one folder) when ``deepspeed.ops`` lists
    it as compatible; that kernel serves only ``inference_all_reduce`` (tensor-parallel inference), not
    training, whose collectives go through torch.distributed (gloo). Listing no op as compatible skips
    both the build and the probe of every op (compiler runs) that would fill the list.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    deepspeed.ops.__compatible_ops__ = {}  # read only by deepspeed.comm.torch.build_shm_op (0.19.8)


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
