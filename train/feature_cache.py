"""Offline mode: the target's outputs computed once over a dataset into sharded safetensors files.

Layout of a cache directory::

    cache.json               what the cache holds (target, layers, top-k, dtypes, shard size)
    shard-00000.safetensors  examples [0, S): tokens concatenated, ``offsets`` [n + 1] marks each one

Each shard stores ``input_ids`` (int32), ``loss_mask`` (uint8), ``features.<layer>`` [N, H] (the
target's dtype if 16-bit, else bfloat16; or float8 e4m3 with a float32 ``features_scale.<layer>`` [N]
per token), ``topk_logits`` [N, K] (bfloat16) and ``topk_ids`` [N, K] (int32; not stored when K
covers the whole vocabulary: the ids are then 0..V-1), with a hash of its rows in the metadata.
A ``final_state`` cache (``cache.teacher``) stores no logits: it keeps the last layer's output as one more
``features.<L-1>``, and every step computes the teacher's top-k from it with the target's final norm and
LM head (``train/teacher.teacher_from_final_state``), the work the peers' offline steps do.
Shards are written to a temporary name and renamed, so a crash leaves only whole shards; a rerun
skips every shard whose row hash still matches. ``train/feature_dataset.py`` reads a cache back.

On several processes, process r of W writes the shards ``i % W == r``; process 0 writes the manifest and
every process waits until all shards are whole. They are the ranks themselves under torchrun or srun, and
each node's first process under Lightning's launcher (``train/distributed.capture_rank`` says why);
training rank r then reads the shards ``i % world_size == r`` (``train/sampler.py``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith import files
from draftsmith.decode.target import Target
from draftsmith.train.teacher import compute_teacher, final_layer

MANIFEST = "cache.json"
FORMAT_VERSION = 1
TEACHERS = ("logits", "final_state")
"""What a cache keeps for the loss's teacher: the top-k logits, or the last layer's output (see above)."""
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value: each token's features are scaled so its absmax lands here
DTYPE_NAMES = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", FP8: "float8_e4m3fn"
}  # fmt: skip


def feature_dtype_for(target_dtype: torch.dtype, choice: str = "auto") -> torch.dtype:
    """Stored feature dtype: the target's when it is 16-bit, else bfloat16 (half the disk); or float8."""
    if choice == "float8":
        return FP8
    if choice == "bfloat16":
        return torch.bfloat16
    if choice != "auto":
        raise ValueError(f"cache feature dtype {choice!r} is not one of auto, bfloat16, float8")
    return target_dtype if target_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def bytes_per_token(
    hidden: int, num_layers: int, topk: int, feature_dtype: torch.dtype, vocab_size: int | None = None
) -> int:
    """Disk bytes one token costs: features (+ a float32 scale per layer in float8) + top-k (bf16 logit
    + int32 id; no ids for the full vocabulary) + int32 token id + uint8 mask."""
    full = vocab_size is not None and topk >= vocab_size
    scale = 4 if feature_dtype == FP8 else 0
    return num_layers * (hidden * feature_dtype.itemsize + scale) + topk * (2 if full else 6) + 4 + 1


def to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, H] float8 e4m3, [N] float32 scale) with x ~= fp8.float() * scale[:, None]."""
    x = x.float()
    scale = x.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (x / scale[:, None]).to(FP8), scale


def from_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale[:, None]).to(torch.bfloat16)


def _rows_hash(rows: Sequence[dict]) -> str:
    h = hashlib.sha256()
    for row in rows:
        ids = torch.as_tensor(row["input_ids"], dtype=torch.int32)
        h.update(len(ids).to_bytes(4, "little") + ids.numpy().tobytes())
        h.update(torch.as_tensor(row["loss_mask"], dtype=torch.uint8).numpy().tobytes())
        if "position_ids" in row:  # packed rows: where each conversation starts is part of the data
            h.update(torch.as_tensor(row["position_ids"], dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


def shard_path(directory: Path, index: int) -> Path:
    """Where shard ``index`` of a cache lives (also for a cache written outside ``build_feature_cache``)."""
    return directory / f"shard-{index:05d}.safetensors"


def _shard_hash(path: Path) -> str | None:
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("rows_hash")
    except Exception:  # unreadable or foreign file: recompute it
        return None


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def build_feature_cache(
    target: Target,
    dataset,
    directory: str | Path,
    layers: Sequence[int],
    topk: int,
    examples_per_shard: int = 256,
    batch_size: int = 8,
    pad_id: int = 0,
    feature_dtype: str = "auto",
    rank: int = 0,
    world_size: int = 1,
    wait_timeout: float = 24 * 3600.0,
    teacher: str = "logits",
) -> Path:
    """Fill ``directory`` with the target's outputs for every row of ``dataset`` (input_ids/loss_mask rows).

    Prints the disk cost before starting; resumable (complete shards of the same rows are skipped).
    With ``world_size`` > 1 this rank writes the shards ``i % world_size == rank`` and returns once every
    rank's shards are whole (the directory must be shared by all ranks).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(target, len(dataset), layers, topk, examples_per_shard, feature_dtype, teacher)
    layers, topk = manifest["layers"], stored_topk(manifest)
    stored_dtype = getattr(torch, manifest["feature_dtype"])
    hidden = int(target.config.hidden_size)
    if rank == 0:
        _write_manifest(directory, manifest)
    else:
        _wait_for(
            lambda: _manifest_matches(directory, manifest),
            wait_timeout,
            f"{directory / MANIFEST} from rank 0",
        )

    num_shards = (len(dataset) + examples_per_shard - 1) // examples_per_shard
    per_token = bytes_per_token(hidden, len(layers), topk, stored_dtype, target.vocab_size)
    what = "full logits (bf16)" if manifest["full_logits"] else f"top-{topk} logits (bf16 + int32 ids)"
    if teacher == "final_state":
        what = (
            f"no logits (the top-{manifest['topk']} taken in each step from layer {manifest['final_layer']})"
        )
    lengths = [len(ids) for ids in dataset["input_ids"]]
    total = per_token * sum(lengths)
    if rank == 0:
        print(
            f"[draftsmith] feature cache {directory}: {len(layers)} layers x {hidden} x {manifest['feature_dtype']}"
            f" + {what} = {per_token:,} bytes/token x {sum(lengths):,} tokens"
            f" = {_human(total)} in {num_shards} shards"
            + (f" over {world_size} ranks" if world_size > 1 else ""),
            flush=True,
        )
        free = shutil.disk_usage(directory).free
        if free < total:
            print(f"[draftsmith] warning: only {_human(free)} free on the cache's disk", flush=True)

    hashes, todo = {}, []
    for shard in range(num_shards):
        rows = dataset.select(
            range(shard * examples_per_shard, min(len(dataset), (shard + 1) * examples_per_shard))
        )
        hashes[shard] = _rows_hash(rows)
        if shard % world_size == rank and _shard_hash(shard_path(directory, shard)) != hashes[shard]:
            todo.append((shard, rows, hashes[shard]))
    mine = len(range(rank, num_shards, world_size))
    if len(todo) < mine:
        print(
            f"[draftsmith] {mine - len(todo)} of {mine} shards{_of_rank(rank, world_size)} already complete; resuming",
            flush=True,
        )
    todo_tokens = sum(sum(len(ids) for ids in rows["input_ids"]) for _, rows, _ in todo)
    with tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="feature cache", disable=not todo) as bar:
        for shard, rows, rows_hash in todo:
            _write_shard(
                target,
                rows,
                shard_path(directory, shard),
                layers,
                topk,
                batch_size,
                pad_id,
                stored_dtype,
                rows_hash,
                bar,
            )
    if world_size > 1:
        missing = lambda: [  # noqa: E731
            shard_path(directory, s).name
            for s, h in hashes.items()
            if _shard_hash(shard_path(directory, s)) != h
        ]
        _wait_for(
            lambda: not missing(), wait_timeout, f"the shards of the other ranks in {directory}", missing
        )
    return directory


def _manifest(
    target: Target,
    num_examples: int,
    layers,
    topk: int,
    examples_per_shard: int,
    feature_dtype: str,
    teacher: str = "logits",
) -> dict:
    """What a cache of these settings records about itself (``cache.json``)."""
    if teacher not in TEACHERS:
        raise ValueError(f"cache teacher {teacher!r} is not one of {', '.join(TEACHERS)}")
    stored_dtype = feature_dtype_for(target.dtype, feature_dtype)
    topk = min(topk, target.vocab_size)
    manifest = {
        "format_version": FORMAT_VERSION,
        "target": target.record(),
        "target_dtype": DTYPE_NAMES[target.dtype],
        "feature_dtype": DTYPE_NAMES[stored_dtype],
        "layers": sorted(int(i) for i in layers),
        "topk": topk,
        "full_logits": topk == target.vocab_size,
        "examples_per_shard": examples_per_shard,
        "num_examples": num_examples,
        "teacher": teacher,
    }
    if teacher == "final_state":  # the last layer's output kept; the top-k is taken in each step, not stored
        final = final_layer(target)
        manifest.update(layers=sorted({*manifest["layers"], final}), full_logits=False, final_layer=final)
    return manifest


def stored_topk(manifest: dict) -> int:
    """Logits per token a cache's shards hold: its top-k, or none in a ``final_state`` cache."""
    return 0 if manifest.get("teacher", "logits") == "final_state" else int(manifest["topk"])


def feature_cache_complete(
    target: Target,
    dataset,
    directory: str | Path,
    layers: Sequence[int],
    topk: int,
    examples_per_shard: int = 256,
    feature_dtype: str = "auto",
    teacher: str = "logits",
) -> bool:
    """Whether ``directory`` already holds every shard ``build_feature_cache`` would write for these rows
    (the target itself is not run, so a skeleton target serves: only its record, dtype and vocabulary are
    read). A cache made with other fixed settings (another target, layers, top-k, ...) is an error naming
    them, as ``build_feature_cache`` gives; a missing manifest or a shard of other rows is just not complete."""
    directory = Path(directory)
    manifest = _manifest(target, len(dataset), layers, topk, examples_per_shard, feature_dtype, teacher)
    try:
        old = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    _check_manifest(directory, old, manifest)
    if old.get("num_examples") != len(dataset):
        return False
    for shard in range((len(dataset) + examples_per_shard - 1) // examples_per_shard):
        rows = dataset.select(
            range(shard * examples_per_shard, min(len(dataset), (shard + 1) * examples_per_shard))
        )
        if _shard_hash(shard_path(directory, shard)) != _rows_hash(rows):
            return False
    return True


def _of_rank(rank: int, world_size: int) -> str:
    return f" of rank {rank}/{world_size}" if world_size > 1 else ""


def _wait_for(done, timeout: float, what: str, details=None) -> None:
    """Poll ``done()`` each second; after ``timeout`` seconds raise naming what never appeared."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            extra = f" (still missing: {details()})" if details is not None else ""
            raise TimeoutError(
                f"waited {timeout:g} s for {what}{extra}; did a rank fail, or is the cache directory "
                "not shared by all ranks (cache.dir must be on a shared filesystem)?"
            )
        time.sleep(1.0)


def _manifest_matches(directory: Path, manifest: dict) -> bool:
    path = directory / MANIFEST
    if not path.exists():
        return False
    try:
        _check_manifest(directory, json.loads(path.read_text()), manifest)
    except json.JSONDecodeError:
        return False
    return True


def _write_manifest(directory: Path, manifest: dict) -> None:
    path = directory / MANIFEST
    if path.exists():
        _check_manifest(directory, json.loads(path.read_text()), manifest)
    files.write_text(path, json.dumps(manifest, indent=2))


def _check_manifest(directory: Path, old: dict, manifest: dict) -> None:
    fixed = (
        "format_version",
        "target",
        "target_dtype",
        "feature_dtype",
        "layers",
        "topk",
        "examples_per_shard",
        "teacher",
    )
    # a cache written before ``teacher`` was recorded holds logits
    diff = [k for k in fixed if old.get(k, "logits" if k == "teacher" else None) != manifest.get(k, "logits")]
    if diff:
        raise ValueError(
            f"{directory} holds a feature cache built with different {', '.join(diff)} "
            f"(was {[old.get(k) for k in diff]}, now {[manifest[k] for k in diff]}); "
            "delete it or point cache.dir at a new directory"
        )


def _write_shard(target, rows, path, layers, topk, batch_size, pad_id, feature_dtype, rows_hash, bar) -> None:
    from draftsmith.train.corpus.tokens import collate

    lengths = [len(ids) for ids in rows["input_ids"]]
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    n_tokens = int(offsets[-1])
    hidden = int(target.config.hidden_size)
    out = {
        "offsets": offsets.to(torch.int64),
        "input_ids": torch.empty(n_tokens, dtype=torch.int32),
        "loss_mask": torch.empty(n_tokens, dtype=torch.uint8),
        "topk_logits": torch.empty(n_tokens, topk, dtype=torch.bfloat16),  # [N, 0] in a final_state cache
        **{f"features.{i}": torch.empty(n_tokens, hidden, dtype=feature_dtype) for i in layers},
    }
    if feature_dtype == FP8:
        out.update({f"features_scale.{i}": torch.empty(n_tokens, dtype=torch.float32) for i in layers})
    packed = "position_ids" in rows[0]
    if packed:
        out["position_ids"] = torch.empty(n_tokens, dtype=torch.int32)
    full = topk == target.vocab_size
    if not full:
        out["topk_ids"] = torch.empty(n_tokens, topk, dtype=torch.int32)
    order = sorted(range(len(rows)), key=lambda r: lengths[r])  # similar lengths together: less padding
    for start in range(0, len(order), batch_size):
        members = order[start : start + batch_size]
        batch = collate([rows[r] for r in members], pad_id)
        teacher = compute_teacher(target, batch, layers, topk)
        for b, r in enumerate(members):
            lo, hi, n = int(offsets[r]), int(offsets[r + 1]), lengths[r]
            out["input_ids"][lo:hi] = batch.input_ids[b, :n]
            out["loss_mask"][lo:hi] = batch.loss_mask[b, :n]
            if packed:
                out["position_ids"][lo:hi] = batch.position_ids[b, :n]
            for i in layers:
                if feature_dtype == FP8:
                    values, scale = to_fp8(teacher.features[i][b, :n].to("cpu"))
                    out[f"features.{i}"][lo:hi], out[f"features_scale.{i}"][lo:hi] = values, scale
                else:
                    out[f"features.{i}"][lo:hi] = teacher.features[i][b, :n].to("cpu", feature_dtype)
            if topk:
                out["topk_logits"][lo:hi] = teacher.topk_logits[b, :n].to("cpu", torch.bfloat16)
            if topk and not full:
                out["topk_ids"][lo:hi] = teacher.topk_ids[b, :n].to("cpu", torch.int32)
        bar.update(sum(lengths[r] for r in members))
    metadata = {"rows_hash": rows_hash, "num_examples": str(len(rows))}
    files.write_with(path, lambda tmp: save_file(out, str(tmp), metadata=metadata))  # whole or absent
