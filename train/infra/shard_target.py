"""The frozen target sharded across the ranks of a node (``target.shard: true``, online mode).

Applied from outside the model, like the strategies in ``train/infra/distributed.py``: PyTorch FSDP2's
``fully_shard`` on every decoder layer, then on the root (embeddings, final norm, LM head). Each rank
keeps 1/world of every weight; a layer's full weights are all-gathered just before its forward and
freed right after (``reshard_after_forward``), so a rank holds its shard plus about one layer at a time.
The target stays frozen: no gradients, no optimizer state, never in the LightningModule. The teacher
(``train/teacher.py``) runs the stock forward with its hooks unchanged. Every rank must call the
target's forward equally often (each forward is a collective), which the loop's rank-balanced samplers
give: one forward per micro-batch, as many micro-batches on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.decode.features import decoder_layers
from draftsmith.train.schema import TrainConfig

SHARDABLE_STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_true")
"""Draft strategies a sharded target runs beside: DDP in the processes the target is sharded over, on the
default process group (auto resolves to it with several devices). Lightning's FSDP for the draft beside
FSDP2 for the target is not offered: it needs GPUs, so it cannot be tested on the CPU, and an EAGLE-3
head for a 70B target fits a rank under DDP (docs/TRAINING.md)."""


def check_shard_target(config: TrainConfig, processes: int) -> None:
    """Refuse ``target.shard`` where it cannot work, before anything is loaded or written; ``processes`` is the
    run's planned world size (``distributed.planned_rank``)."""
    if not config.target.shard:
        return
    if config.mode != "online":
        raise ValueError(
            "target.shard shards the target that runs inside every step, which is mode: online; in mode: "
            "offline the target only fills the feature cache: set target.shard: false (or mode: online)"
        )
    strategy = config.trainer.strategy
    if strategy not in SHARDABLE_STRATEGIES:
        if strategy == "ddp_spawn":
            why = "it spawns its ranks from a process that already holds the whole target"
        elif strategy.startswith("fsdp"):
            why = "sharding the draft too beside a sharded target is not supported yet"
        else:
            why = "DeepSpeed runs its own engine and partitioning, not combined with the target's FSDP2"
        raise ValueError(
            f"target.shard cannot combine with trainer.strategy={strategy!r} ({why}): use trainer.strategy: ddp"
        )
    if config.target.device_map == "auto":
        raise ValueError(
            "target.shard and target.device_map: auto both split the target (one process spreading it over "
            "its GPUs vs ranks each holding a shard): keep one; for several ranks set target.device_map: null"
        )
    if processes < 2:
        raise ValueError(
            f"target.shard needs 2 or more processes to shard the target over, and this run has {processes}: "
            "set trainer.devices to the GPUs of the node (or launch with torchrun --nproc-per-node N), "
            "or set target.shard: false"
        )


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_frozen_target(model: nn.Module, device: torch.device) -> nn.Module:
    """Shard ``model`` in place over all ranks of the default process group, onto ``device``.

    Each decoder layer is its own unit (gathered for its forward, freed after), and so are the input
    embedding and the LM head when they are not tied (a 128k vocabulary makes each as large as a layer);
    the root holds the rest.
    The weights move to ``device`` one unit at a time, so a rank never holds the whole target there.
    Calling it again on a sharded model does nothing.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model):
        return model
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        raise RuntimeError(
            "target.shard: no process group of 2 or more ranks at the start of training; launch with "
            "trainer.devices >= 2 (or torchrun --nproc-per-node N), or set target.shard: false"
        )
    model.requires_grad_(False).eval()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units = list(decoder_layers(model))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is not embed.weight:  # untied: each gathered only for its own step
        units += [embed, head]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)  # the rest: tied embeddings, final norm
    return model


def local_parameter_count(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model): a sharded parameter counts its local shard."""
    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return local, total
