"""What a run checks before it loads the target, so a bad recipe fails in a second and leaves nothing:
the output folder, a finished draft or a run already there, the data files, the draft kind and its
options, and a resume's recipe against the run's own (``config.yaml``)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from draftsmith import files
from draftsmith.sources import check_source
from draftsmith.train.infra.checkpoint import CHECKPOINT_DIR, DRAFT_DIR, LAST, TRAIN_STATE, resume_point
from draftsmith.train.infra.loggers import check_loggers
from draftsmith.train.registry import check_objective_options
from draftsmith.train.schema import TrainConfig, to_dict

RESUME_SAFE = ("trainer.max_steps", "trainer.max_time", "trainer.log_every", "trainer.ckpt_every",
               "trainer.keep_checkpoints", "trainer.loggers", "trainer.devices", "trainer.num_nodes",
               "trainer.strategy", "trainer.accelerator", "trainer.num_workers", "target.device",
               "target.device_map", "target.shard")  # fmt: skip
"""Recipe keys a resumed run may change without breaking exact resume: when it stops, logging, and where
it runs (docs/TRAINING.md, "Another world size"; ``trainer.batch_size`` too while the global batch stays)."""
RECIPE_HISTORY = "recipe_history.jsonl"


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value and key != "options":
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def recipe_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """``{dotted key: (saved, current)}`` where the run's recorded recipe and this one differ."""
    a, b = flatten(saved), flatten(current)
    return {
        k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k != "output.dir"
    }


def as_read_now(saved: dict) -> dict:
    """A run's recorded recipe as this version's schema reads it: keys added since it was written take their
    defaults, so resuming after an upgrade is no recipe change; a recipe it cannot read is compared as written."""
    try:
        return to_dict(TypeAdapter(TrainConfig).validate_python(saved))
    except (ValidationError, ValueError, TypeError):
        return saved


def global_batch(recipe: dict) -> int | None:
    """Rows per optimizer step over all processes (None when the device count is not a number)."""
    t = recipe.get("trainer") or {}
    sizes = [t.get("batch_size"), t.get("devices", 1), t.get("num_nodes", 1), t.get("grad_accum", 1)]
    return math.prod(sizes) if all(isinstance(n, int) for n in sizes) else None


def preflight(config: TrainConfig, resume: bool, overwrite: bool, force_resume: bool) -> dict[str, tuple]:
    """Check what can be checked before loading the target; return the recipe changes of a resume."""
    output_dir = Path(config.output.dir)
    files.check_writable(output_dir, "output.dir")
    ckpt = resume_point(output_dir)  # last.ckpt, or the newest step checkpoint where it is gone
    if resume and ckpt is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint at {output_dir / CHECKPOINT_DIR / LAST} nor any step checkpoint beside it; "
            "run without --resume"
        )
    if resume:  # written whole and renamed into place: a damaged one was cut short by a copy or a move
        files.check_checkpoint(
            ckpt, "Copy it again from where it came, or start the run anew in another --output.dir"
        )
    if not resume and ckpt is not None:
        raise ValueError(
            f"{output_dir} already holds a run ({ckpt}); pass --resume to continue it, "
            "or set --output.dir to a new directory"
        )
    draft = output_dir / DRAFT_DIR
    if not resume and draft.is_dir() and any(draft.iterdir()) and not overwrite:
        raise ValueError(
            f"{draft} holds a trained draft; a new run would replace it. Pass --overwrite to replace it, or "
            "set --output.dir to a new directory"
        )
    if not resume and draft.is_dir() and any(draft.iterdir()) and not (draft / TRAIN_STATE).is_file():
        raise ValueError(  # --overwrite replaces a draft a run trained there, never a folder of the user's
            f"{draft} is not a draft draftsmith trained: it holds {files.listing(draft)} and no {TRAIN_STATE}. "
            "--overwrite replaces only a trained draft, never your own files: set --output.dir to a new directory"
        )
    d = config.data
    paths = [d.regenerated] if d.regenerated else list(d.paths)
    if not paths:
        raise FileNotFoundError("data.paths lists no data: name files, builtin: data sets or hf: datasets")
    for spec in paths:
        check_source(spec, "data.regenerated" if d.regenerated else "data.paths entry")
    check_objective_options(config.draft.kind, config.draft.options)
    check_loggers(config.trainer.loggers)
    if not resume or not (output_dir / "config.yaml").is_file():
        return {}
    saved = yaml.safe_load((output_dir / "config.yaml").read_text()) or {}
    changes = recipe_changes(as_read_now(saved), to_dict(config))
    unsafe = {k: v for k, v in changes.items() if k not in RESUME_SAFE}
    if (
        set(unsafe) == {"trainer.batch_size"}
        and global_batch(saved) == global_batch(to_dict(config)) is not None
    ):
        unsafe = {}  # the same rows per step on another number of processes
    if unsafe and not force_resume:
        listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in unsafe.items())
        raise ValueError(
            f"--resume with another recipe than the run's ({output_dir / 'config.yaml'}): {listed}. Exact resume "
            "needs the same recipe (only when it stops, logging, and where it runs may change, and batch_size "
            "with the global batch kept); drop the changes, start a new "
            "--output.dir, or pass --force-resume to resume anyway (the change is kept in the run's "
            f"{RECIPE_HISTORY})"
        )
    return changes


def record_recipe_change(output_dir: Path, changes: dict[str, tuple], forced: bool) -> None:
    """Append what a resume changed to the run's record (config.yaml then holds the new recipe)."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "forced": forced,
             "changes": {k: {"was": old, "now": new} for k, (old, new) in changes.items()}}  # fmt: skip
    path = output_dir / RECIPE_HISTORY
    old = path.read_text() if path.exists() else ""
    files.write_text(path, old + json.dumps(entry) + "\n")
