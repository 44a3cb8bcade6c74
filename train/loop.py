"""The one training run every draft kind uses (Lightning), driven by a ``TrainConfig``: data, the offline
feature cache, the objective, the ``DraftModule`` (``train/module.py``), the Trainer, and the final
validation and export.

``--resume`` continues from the last checkpoint exactly where the run stopped: weights, optimizer,
scheduler, data position and RNG states (``train/sampler.py``, ``train/infra/resume.py``). Strategies (DDP,
FSDP, DeepSpeed) come from the config through ``train/infra/distributed.py``; nothing here depends on how
many processes run it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import LearningRateMonitor
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from draftsmith import files
from draftsmith.decode.target import Target, load_target, load_target_skeleton
from draftsmith.train.corpus.dataset_cache import cached_dataset
from draftsmith.train.corpus.dataset_cache import default_root as default_dataset_root
from draftsmith.train.corpus.tokens import build_dataset, collate, count_tokens, pad_id_of, split_heldout
from draftsmith.train.feature_cache import build_feature_cache, feature_cache_complete
from draftsmith.train.feature_dataset import FeatureCache, collate_cached
from draftsmith.train.infra.checkpoint import (
    CHECKPOINT_DIR,
    DRAFT_DIR,
    LAST,
    AtomicCheckpointIO,
    StepCheckpoints,
    check_resume_target,
    last_checkpoint,
    remove_partial_checkpoints,
    resume_point,
)
from draftsmith.train.infra.distributed import (
    build_strategy,
    capture_rank,
    check_strategy,
    enable_activation_checkpointing,
    planned_rank,
    resolve_auto_precision,
    target_device,
)
from draftsmith.train.infra.faults import (
    FiniteGuard,
    NonFiniteError,
    OutputLock,
    Preemption,
    Stopped,
    disk_full_error,
    next_step,
    nonfinite_line,
    stop_on_signals,
    stopped_line,
)
from draftsmith.train.infra.loggers import build_loggers, where
from draftsmith.train.infra.preflight import preflight, record_recipe_change
from draftsmith.train.infra.progress import StepProgress, quiet_loading, quiet_said_already
from draftsmith.train.infra.resume import ExactResume
from draftsmith.train.infra.shard_target import check_shard_target
from draftsmith.train.module import DraftModule
from draftsmith.train.registry import build_objective
from draftsmith.train.sampler import EvalSampler, ResumableDataLoader, ResumableSampler
from draftsmith.train.schema import TrainConfig, to_dict

TOKEN_COUNTS = "token_counts.safetensors"


# --------------------------------------------------------------------------- data


def prepare_datasets(config: TrainConfig, tokenizer, rank: int = 0):
    """(train, heldout) datasets of input_ids/loss_mask rows, rendered with the target's chat template.

    The rows are rendered and packed once into the dataset cache (``data.cache_dir``, by default
    <output.dir>/dataset_cache; ``train/corpus/dataset_cache.py``): a restart, a requeue and the ranks after
    rank 0 read them back instead."""
    d = config.data
    paths = [d.regenerated] if d.regenerated else d.paths
    root = Path(d.cache_dir) if d.cache_dir else default_dataset_root(config.output.dir)
    unused = ("paths", "regenerated", "heldout", "cache_dir")  # the sources are fingerprinted apart
    settings = {k: v for k, v in to_dict(config)["data"].items() if k not in unused}

    def enough(ds):
        if len(ds) <= d.heldout:
            raise ValueError(
                f"only {len(ds)} training sequences in {paths}, not more than data.heldout={d.heldout}; "
                "add data or lower data.heldout"
            )
        return ds

    def build():  # checked before it is stored: a recipe with too few rows leaves no entry
        return enough(build_dataset(paths, tokenizer, d.max_length, pack=d.pack, limit=d.limit, seed=d.seed,
                                    system=d.system, template_args=d.template_args))  # fmt: skip

    ds = enough(cached_dataset(root, paths, tokenizer, settings, build, rank=rank))
    return split_heldout(ds, d.heldout, d.seed)


def make_loaders(
    config: TrainConfig, train_ds, heldout_ds, pad_id: int, cache_dirs: tuple[Path, Path] | None, dtype
):
    """(train, val) DataLoaders yielding Batch (online) or (Batch, Teacher) from the feature cache (offline).

    Training rows come in the resumable, rank-sharded order of ``ResumableSampler`` (one global
    shuffle online; the cache's shards split across ranks offline); held-out rows are split across ranks.
    """
    t = config.trainer
    if cache_dirs is None:
        collate_fn = partial(collate, pad_id=pad_id)
        sources = (train_ds, heldout_ds)
        shard_sizes = None
    else:
        collate_fn = partial(collate_cached, pad_id=pad_id, dtype=dtype)
        sources = (FeatureCache(cache_dirs[0]), FeatureCache(cache_dirs[1]))
        shard_sizes = sources[0].shard_sizes
    sampler = ResumableSampler(len(sources[0]), t.batch_size, seed=t.seed, shard_sizes=shard_sizes)
    kwargs = dict(collate_fn=collate_fn, num_workers=t.num_workers)
    return (
        ResumableDataLoader(sources[0], sampler, **kwargs),
        DataLoader(sources[1], batch_size=t.batch_size, sampler=EvalSampler(len(sources[1])), **kwargs),
    )


# --------------------------------------------------------------------------- the run


def rows_to_cache(train_ds, config: TrainConfig, world_size: int, rank: int = 0):
    """The training rows an offline run caches: all of them, or, when its ``max_steps`` read fewer than one
    pass, that many in a fixed shuffle of the data (``data.seed``), rounded up to whole shards on every
    rank. A longer run in the same ``cache.dir`` takes a longer prefix of the same shuffle, so the shards
    already written are reused and only the new ones are computed."""
    t, per_shard = config.trainer, config.cache.examples_per_shard
    reads = t.max_steps * t.batch_size * t.grad_accum * world_size
    rows = min(len(train_ds), -(-reads // (per_shard * world_size)) * per_shard * world_size)
    if rows >= len(train_ds):
        return train_ds
    if rank == 0:
        print(
            f"[draftsmith] offline: {t.max_steps} steps read {reads:,} of the {len(train_ds):,} training rows; "
            f"caching {rows:,} of them (data.seed {config.data.seed}; a longer run adds to the cache)",
            flush=True,
        )
    order = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(config.data.seed))
    return train_ds.select(order[:rows].tolist())


@dataclass
class TrainResult:
    output_dir: Path
    draft_dir: Path
    checkpoint: Path | None
    steps: int
    val: dict[str, float]
    """The last validation: tau, acc_pos_i."""
    loggers: tuple[str, ...] = ("csv", "tensorboard")
    """Where the metrics went (``trainer.loggers``)."""


def make_trainer(config: TrainConfig, output_dir: Path, **overrides) -> L.Trainer:
    t = config.trainer
    callbacks = [
        StepCheckpoints(  # last.ckpt, and the last keep_checkpoints step checkpoints beside it
            dirpath=output_dir / CHECKPOINT_DIR,
            filename="step-{step:07d}",
            auto_insert_metric_name=False,
            monitor="step" if t.keep_checkpoints else None,
            mode="max",
            every_n_train_steps=t.ckpt_every,
            save_top_k=t.keep_checkpoints,
            save_last=True,
            enable_version_counter=False,
        ),
        LearningRateMonitor(logging_interval="step"),
        *overrides.pop("callbacks", []),
    ]
    show_progress = overrides.pop("enable_progress_bar", True)
    if show_progress:
        callbacks.append(StepProgress())  # in place of Lightning's per-epoch bars
        quiet_said_already()
    kwargs = dict(
        max_steps=t.max_steps,
        num_nodes=t.num_nodes,
        use_distributed_sampler=False,  # the loaders shard by rank themselves (train/sampler.py)
        max_epochs=-1,
        accumulate_grad_batches=t.grad_accum,
        gradient_clip_val=config.optim.grad_clip,
        val_check_interval=t.val_every * t.grad_accum,  # counted in micro-batches
        check_val_every_n_epoch=None,
        log_every_n_steps=t.log_every,
        precision=t.precision,
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=build_strategy(t),
        default_root_dir=output_dir,
        logger=build_loggers(t.loggers, output_dir) or False,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        num_sanity_val_steps=1,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    if t.max_time is not None:
        kwargs["max_time"] = timedelta(minutes=t.max_time)
    kwargs.update(overrides)
    # Lightning's start-up lines (AMP in use, GPU/TPU/HPU available) say what the recipe already said: one
    # line of draftsmith's instead, where the run shows its own progress
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = lightning_info.level
    if show_progress:
        lightning_info.setLevel(logging.WARNING)
    try:
        trainer = L.Trainer(**kwargs)
    finally:
        lightning_info.setLevel(level)
    if show_progress and trainer.is_global_zero:
        processes = trainer.world_size
        print(f"[draftsmith] training on {type(trainer.accelerator).__name__.removesuffix('Accelerator').lower()}, "
              f"{processes} process{'es' if processes > 1 else ''}, precision {t.precision}, {t.max_steps} steps",
              flush=True)  # fmt: skip
    return trainer


def train(
    config: TrainConfig,
    resume: bool = False,
    target: Target | None = None,
    overwrite: bool = False,
    force_resume: bool = False,
    resume_command: str | None = None,
    rerun_command: str | None = None,
    **trainer_overrides,
) -> TrainResult:
    """Run a whole training from a config: data, (offline cache), objective, fit, final validation, export.

    Everything that can be checked without the target is checked first (``preflight``), so a bad recipe
    fails in a second and leaves nothing behind. ``overwrite`` replaces a finished draft in the output
    folder; ``force_resume`` resumes although the recipe changed in a way that can break exact resume.
    The output folder is locked for the run (``train/infra/faults.py``); SIGTERM, SIGUSR1 and SIGINT save a
    checkpoint at the next step and stop with 128 + the signal, printing ``resume_command`` (default:
    ``draftsmith train <output.dir>/config.yaml --resume``); outside the training steps they stop at once.
    A stop or a full disk before the first checkpoint prints ``rerun_command`` instead (default:
    ``draftsmith train <output.dir>/config.yaml``), the command that works then. A loss, gradient or weight
    that turns infinite or NaN stops the run at that step (``NonFiniteError``) with one line naming the step
    and the last good checkpoint; nothing non-finite is checkpointed or exported.
    """
    output_dir = Path(config.output.dir)
    quiet_said_already()  # before the target loads: DeepSpeed's CPU notice comes with its first import
    check_shard_target(config, planned_rank(config.trainer)[2])
    check_strategy(config.trainer)
    resolved = resolve_auto_precision(config)
    if resolved != config:
        print(
            f"[draftsmith] auto precision on this machine: trainer.precision={resolved.trainer.precision}, "
            f"target.dtype={resolved.target.dtype}",
            flush=True,
        )
    config = resolved
    preflight(config, resume, overwrite, force_resume)  # before the lock: a bad recipe writes nothing
    # the rank and world size training will have, before Lightning's launcher starts the other ranks as after
    rank, _, world_size = planned_rank(config.trainer)
    resume_command = (
        resume_command or f"draftsmith train {shlex.quote(str(output_dir / 'config.yaml'))} --resume"
    )
    cache_dir = Path(config.cache.dir) if config.cache.dir else output_dir / "feature_cache"
    try:
        with stop_on_signals(), OutputLock(output_dir) if rank == 0 else contextlib.nullcontext():
            return _train_locked(
                config,
                resume,
                target,
                overwrite,
                force_resume,
                resume_command,
                rank,
                world_size,
                trainer_overrides,
            )
    except Stopped as stop:  # outside the training steps: say what is kept and what goes on from it
        if rank == 0:
            print(stopped_line(stop.signum, *next_step(output_dir, resume_command, rerun_command, cache_dir)),
                  flush=True)  # fmt: skip
        raise
    except NonFiniteError as err:  # stopped before that step saved anything: the line names what is kept
        err.args = (
            nonfinite_line(
                err, *next_step(output_dir, resume_command, rerun_command, cache_dir), config.optim.lr
            ),
        )
        raise
    except (OSError, RuntimeError) as err:
        kept, go_on = next_step(output_dir, resume_command, rerun_command, cache_dir)
        full = disk_full_error(err, output_dir, kept, go_on)
        if full is None:
            raise
        raise full from err


def _train_locked(
    config, resume, target, overwrite, force_resume, resume_command, rank, world_size, trainer_overrides
) -> TrainResult:
    output_dir = Path(config.output.dir)
    changes = preflight(config, resume, overwrite, force_resume)  # again, now that no other job can write
    ckpt = resume_point(output_dir)
    if resume and rank == 0 and ckpt is not None and ckpt.name != LAST:
        print(
            f"[draftsmith] --resume: {output_dir / CHECKPOINT_DIR / LAST} is gone; resuming from the newest step "
            f"checkpoint, {ckpt}",
            flush=True,
        )
    if rank == 0:
        remove_partial_checkpoints(output_dir)  # left by a run killed while writing one
        files.remove_stale(output_dir, DRAFT_DIR)  # ... or while exporting the draft
    L.seed_everything(config.trainer.seed, workers=True, verbose=False)
    if target is None:
        # offline: the target's layers only if the capture runs
        target = _load_target(config, whole=config.mode != "offline")
    train_ds, heldout_ds = prepare_datasets(config, target.tokenizer, rank)
    pad_id = pad_id_of(target.tokenizer)

    counts_path = output_dir / TOKEN_COUNTS
    if resume and counts_path.exists():
        token_counts = load_file(str(counts_path))["token_counts"]
    else:
        token_counts = count_tokens(train_ds, target.vocab_size)
    objective = build_objective(config.draft.kind, target, config.draft.options, token_counts)
    if resume and ckpt is not None and rank == 0:  # another target is refused before the recipe is rewritten
        frozen = {
            f"draft.{n}": p for n, p in objective.build_draft().named_parameters() if not p.requires_grad
        }
        if not any(
            p.is_meta for p in frozen.values()
        ):  # a skeleton target: checked when the checkpoint loads
            check_resume_target(ckpt, frozen, config.target.spec)
        del frozen
    if rank == 0:  # written once the recipe has built: a run that fails earlier leaves nothing behind
        if not counts_path.exists() or not resume:
            files.write_with(counts_path, lambda p: save_file({"token_counts": token_counts}, str(p)))
        files.write_text(output_dir / "config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False))
        if changes:
            record_recipe_change(output_dir, changes, force_resume)

    cache_dirs = None
    if config.mode == "offline" and objective.on_policy:
        raise ValueError(
            f"draft kind {config.draft.kind!r} is set to sample on-policy data, which the target must score "
            "as it is made: use mode: online (or set draft.options.on_policy_fraction: 0)"
        )
    if config.mode == "offline":
        root = Path(config.cache.dir) if config.cache.dir else output_dir / "feature_cache"
        cache_dirs = (root / "train", root / "heldout")
        c = config.cache
        train_ds = rows_to_cache(train_ds, config, world_size, rank)
        complete = all(
            feature_cache_complete(target, ds, directory, objective.capture_layers, objective.teacher_topk,
                                   c.examples_per_shard, c.feature_dtype, c.teacher)
            for ds, directory in zip((train_ds, heldout_ds), cache_dirs)
        )  # fmt: skip
        if not target.materialized and (not complete or objective.reads_target_layers):
            target = _load_target(config, whole=True)  # the capture (or the draft) needs the target's layers
            objective = build_objective(config.draft.kind, target, config.draft.options, token_counts)
        if complete:
            if rank == 0:
                print(
                    f"[draftsmith] offline: the feature cache {root} is complete"
                    + ("; the target's layers are not loaded" if not target.materialized else ""),
                    flush=True,
                )
        else:
            capturer, capturers = capture_rank(config.trainer)  # only the processes alive now: see there
            for ds, directory in zip((train_ds, heldout_ds), cache_dirs):
                build_feature_cache(
                    target, ds, directory, objective.capture_layers, objective.teacher_topk, c.examples_per_shard,
                    c.batch_size, pad_id, feature_dtype=c.feature_dtype, rank=capturer, world_size=capturers,
                    teacher=c.teacher,
                )  # fmt: skip
        if target.materialized:
            target.model.to("cpu")  # offline: the target's work is done; free the accelerator for the draft
    train_loader, val_loader = make_loaders(config, train_ds, heldout_ds, pad_id, cache_dirs, target.dtype)

    module = DraftModule(objective, config, target, output_dir)
    if config.trainer.activation_checkpointing:
        enable_activation_checkpointing(module.draft, config.draft.kind)
    last = output_dir / CHECKPOINT_DIR / LAST
    preemption = Preemption(lambda trainer: trainer.save_checkpoint(last) or last, resume_command)
    callbacks = [
        ExactResume(train_loader.sampler, objective),
        FiniteGuard(),  # a non-finite loss, gradient or weight stops the run before its step is saved
        preemption,
        *trainer_overrides.pop("callbacks", []),
    ]
    trainer = make_trainer(config, output_dir, callbacks=callbacks, **trainer_overrides)
    try:
        trainer.fit(module, train_loader, val_loader, ckpt_path=str(ckpt) if resume else None)
        # all of it, and quietly; before validate, which re-initialises a DeepSpeed engine for inference
        # (no optimizer: a checkpoint saved from it has no ZeRO optimizer states and cannot be resumed)
        trainer.save_checkpoint(last, weights_only=False)
        if not module.val_history or module.val_history[-1]["step"] != trainer.global_step:
            trainer.validate(module, val_loader, verbose=False)  # final τ for the final weights (and export)
    finally:
        preemption.restore()
    val = {k: v for k, v in module.val_history[-1].items() if k not in ("step", "histogram")}
    result = TrainResult(
        output_dir, output_dir / DRAFT_DIR, last_checkpoint(output_dir), trainer.global_step, val,
        tuple(config.trainer.loggers),
    )  # fmt: skip
    if trainer.is_global_zero:
        print_summary(result)
    preemption.after_run()  # a signal during the final validation or export: saved, yet not exit 0
    return result


@quiet_loading()  # transformers' bar over the weights: the load is said by draftsmith's lines around it
def _load_target(config: TrainConfig, whole: bool) -> Target:
    """The configured target; with ``whole`` False a skeleton (``load_target_skeleton``: the embedding, final
    norm and LM head read from its safetensors, the layers never materialised), or the whole target where its
    checkpoint cannot be read that way (a note says why)."""
    tc = config.target
    if not whole:
        try:
            return load_target_skeleton(tc.spec, "cpu", tc.dtype, tc.chat_template)
        except (ValueError, FileNotFoundError) as err:
            print(f"[draftsmith] offline: loading the whole target ({err})", flush=True)
    # a sharded target is opened on the host and moved to the device shard by shard (DraftModule.on_fit_start)
    return load_target(
        tc.spec, device="cpu" if tc.shard else target_device(tc.device), dtype=tc.dtype,
        device_map=tc.device_map, chat_template=tc.chat_template,
    )  # fmt: skip


def print_summary(result: TrainResult) -> None:
    rates = " ".join(  # nan: no chain reached that position
        "-" if math.isnan(v) else f"{v:.2f}" for k, v in result.val.items() if k.startswith("acc_pos_")
    )
    print(
        f"\n[draftsmith] trained {result.steps} steps; final val τ = {result.val['tau']:.3f}"
        f" (acceptance by position: {rates})\n"
        f"  draft:      {result.draft_dir}   (draftsmith eval --draft {result.draft_dir})\n"
        f"  checkpoint: {result.checkpoint}   (continue with --resume)\n"
        f"  logs:       {where(result.loggers, result.output_dir)}",
        flush=True,
    )
