"""Offline mode: the target's outputs computed once over a dataset into sharded safetensors files.

Layout of a cache directory::

    cache.json               what the cache holds (target, layers, top-k, dtypes, shard size)
    shard-00000.safetensors  examples [0, S): tokens concatenated, ``offsets`` [n + 1] marks each one

Each shard stores ``input_ids`` (int32), ``loss_mask`` (uint8), ``features.<layer>`` [N, H] (the
target's dtype if 16-bit, else bfloat16), ``topk_logits`` [N, K] (bfloat16) and ``topk_ids`` [N, K]
(int32; not stored when K covers the whole vocabulary: the ids are then 0..V-1), with a hash of its
rows in the metadata. Shards are written to a temporary name and renamed,
so a crash leaves only whole shards; a rerun skips every shard whose row hash still matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.decode.target import Target
from draftsmith.train.objective import Batch, Teacher
from draftsmith.train.teacher import compute_teacher

MANIFEST = "cache.json"
FORMAT_VERSION = 1
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def feature_dtype_for(target_dtype: torch.dtype) -> torch.dtype:
    """Features are stored in the target's dtype when it is 16-bit, else in bfloat16 (half the disk)."""
    return target_dtype if target_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def bytes_per_token(
    hidden: int, num_layers: int, topk: int, feature_dtype: torch.dtype, vocab_size: int | None = None
) -> int:
    """Disk bytes one token costs: features + top-k (bf16 logit + int32 id; no ids for the full
    vocabulary) + int32 token id + uint8 mask."""
    full = vocab_size is not None and topk >= vocab_size
    return hidden * num_layers * feature_dtype.itemsize + topk * (2 if full else 6) + 4 + 1


def _rows_hash(rows: Sequence[dict]) -> str:
    h = hashlib.sha256()
    for row in rows:
        ids = torch.as_tensor(row["input_ids"], dtype=torch.int32)
        h.update(len(ids).to_bytes(4, "little") + ids.numpy().tobytes())
        h.update(torch.as_tensor(row["loss_mask"], dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _shard_path(directory: Path, index: int) -> Path:
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
) -> Path:
    """Fill ``directory`` with the target's outputs for every row of ``dataset`` (input_ids/loss_mask rows).

    Prints the disk cost before starting; resumable (complete shards of the same rows are skipped).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = sorted(int(i) for i in layers)
    feature_dtype = feature_dtype_for(target.dtype)
    hidden = int(target.config.hidden_size)
    topk = min(topk, target.vocab_size)
    manifest = {
        "format_version": FORMAT_VERSION,
        "target": target.record(),
        "target_dtype": _DTYPE_NAMES[target.dtype],
        "feature_dtype": _DTYPE_NAMES[feature_dtype],
        "layers": layers,
        "topk": topk,
        "full_logits": topk == target.vocab_size,
        "examples_per_shard": examples_per_shard,
        "num_examples": len(dataset),
    }
    _write_manifest(directory, manifest)

    num_shards = (len(dataset) + examples_per_shard - 1) // examples_per_shard
    per_token = bytes_per_token(hidden, len(layers), topk, feature_dtype, target.vocab_size)
    what = "full logits (bf16)" if manifest["full_logits"] else f"top-{topk} logits (bf16 + int32 ids)"
    lengths = [len(ids) for ids in dataset["input_ids"]]
    total = per_token * sum(lengths)
    print(
        f"[draftsmith] feature cache {directory}: {len(layers)} layers x {hidden} x {manifest['feature_dtype']}"
        f" + {what} = {per_token:,} bytes/token x {sum(lengths):,} tokens"
        f" = {_human(total)} in {num_shards} shards",
        flush=True,
    )
    free = shutil.disk_usage(directory).free
    if free < total:
        print(f"[draftsmith] warning: only {_human(free)} free on the cache's disk", flush=True)

    todo = []
    for shard in range(num_shards):
        rows = dataset.select(
            range(shard * examples_per_shard, min(len(dataset), (shard + 1) * examples_per_shard))
        )
        rows_hash = _rows_hash(rows)
        if _shard_hash(_shard_path(directory, shard)) != rows_hash:
            todo.append((shard, rows, rows_hash))
    if len(todo) < num_shards:
        print(
            f"[draftsmith] {num_shards - len(todo)} of {num_shards} shards already complete; resuming",
            flush=True,
        )
    todo_tokens = sum(sum(len(ids) for ids in rows["input_ids"]) for _, rows, _ in todo)
    with tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="feature cache", disable=not todo) as bar:
        for shard, rows, rows_hash in todo:
            _write_shard(
                target,
                rows,
                _shard_path(directory, shard),
                layers,
                topk,
                batch_size,
                pad_id,
                feature_dtype,
                rows_hash,
                bar,
            )
    return directory


def _write_manifest(directory: Path, manifest: dict) -> None:
    path = directory / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        fixed = (
            "format_version",
            "target",
            "target_dtype",
            "feature_dtype",
            "layers",
            "topk",
            "examples_per_shard",
        )
        diff = [k for k in fixed if old.get(k) != manifest[k]]
        if diff:
            raise ValueError(
                f"{directory} holds a feature cache built with different {', '.join(diff)} "
                f"(was {[old.get(k) for k in diff]}, now {[manifest[k] for k in diff]}); "
                "delete it or point cache.dir at a new directory"
            )
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, path)


def _write_shard(target, rows, path, layers, topk, batch_size, pad_id, feature_dtype, rows_hash, bar) -> None:
    from draftsmith.train.data import collate

    lengths = [len(ids) for ids in rows["input_ids"]]
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    n_tokens = int(offsets[-1])
    hidden = int(target.config.hidden_size)
    out = {
        "offsets": offsets.to(torch.int64),
        "input_ids": torch.empty(n_tokens, dtype=torch.int32),
        "loss_mask": torch.empty(n_tokens, dtype=torch.uint8),
        "topk_logits": torch.empty(n_tokens, topk, dtype=torch.bfloat16),
        **{f"features.{i}": torch.empty(n_tokens, hidden, dtype=feature_dtype) for i in layers},
    }
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
            for i in layers:
                out[f"features.{i}"][lo:hi] = teacher.features[i][b, :n].to("cpu", feature_dtype)
            if topk:
                out["topk_logits"][lo:hi] = teacher.topk_logits[b, :n].to("cpu", torch.bfloat16)
            if topk and not full:
                out["topk_ids"][lo:hi] = teacher.topk_ids[b, :n].to("cpu", torch.int32)
        bar.update(sum(lengths[r] for r in members))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(out, str(tmp), metadata={"rows_hash": rows_hash, "num_examples": str(len(rows))})
    os.replace(tmp, path)  # atomic: a shard is either whole or absent


class FeatureCache(torch.utils.data.Dataset):
    """Read a cache back: item i is one example's tokens and teacher outputs (unpadded tensors)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not path.exists():
            raise FileNotFoundError(
                f"{self.directory} is not a feature cache (no {MANIFEST}); build it first"
            )
        self.manifest = json.loads(path.read_text())
        self.layers = [int(i) for i in self.manifest["layers"]]
        self.topk = int(self.manifest["topk"])
        self.full_logits = bool(self.manifest.get("full_logits", False))
        self.target_dtype = getattr(torch, self.manifest["target_dtype"])
        per_shard = int(self.manifest["examples_per_shard"])
        n = int(self.manifest["num_examples"])
        self._offsets: list[torch.Tensor] = []
        for shard in range((n + per_shard - 1) // per_shard):
            shard_path = _shard_path(self.directory, shard)
            if not shard_path.exists():
                raise FileNotFoundError(
                    f"feature cache {self.directory} is incomplete: {shard_path.name} is missing; rebuild it"
                )
            with safe_open(str(shard_path), "pt") as f:
                self._offsets.append(f.get_tensor("offsets"))
        self._per_shard = per_shard
        self._len = n
        self._handles: dict[int, object] = {}  # opened lazily: safe_open handles do not pickle to workers

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": {}}

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self._len:
            raise IndexError(index)
        shard, local = divmod(index, self._per_shard)
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(_shard_path(self.directory, shard)), "pt")
        f = self._handles[shard]
        lo, hi = int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        ids = None
        if self.topk and self.full_logits:
            ids = torch.arange(self.topk).expand(hi - lo, self.topk)
        elif self.topk:
            ids = f.get_slice("topk_ids")[lo:hi]
        return {
            "input_ids": f.get_slice("input_ids")[lo:hi],
            "loss_mask": f.get_slice("loss_mask")[lo:hi],
            "features": {i: f.get_slice(f"features.{i}")[lo:hi] for i in self.layers},
            "topk_logits": f.get_slice("topk_logits")[lo:hi] if self.topk else None,
            "topk_ids": ids,
        }


def collate_cached(
    rows: Sequence[dict], pad_id: int, dtype: torch.dtype | None = None
) -> tuple[Batch, Teacher]:
    """Right-pad cached examples into (Batch, Teacher); features cast to ``dtype`` (the target's) if given.

    Padded positions hold zeros (and pad_id tokens); they have attention_mask and loss_mask 0.
    """
    width = max(len(r["input_ids"]) for r in rows)
    bsz = len(rows)
    input_ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(bsz, width, dtype=torch.long)
    loss_mask = torch.zeros(bsz, width, dtype=torch.long)
    first = rows[0]
    features = {
        i: torch.zeros(bsz, width, f.shape[-1], dtype=dtype or f.dtype) for i, f in first["features"].items()
    }
    has_topk = first["topk_logits"] is not None
    if has_topk:
        k = first["topk_logits"].shape[-1]
        topk_logits = torch.zeros(bsz, width, k, dtype=torch.float32)
        topk_ids = torch.zeros(bsz, width, k, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = row["input_ids"]
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = row["loss_mask"]
        for i, f in row["features"].items():
            features[i][b, :n] = f
        if has_topk:
            topk_logits[b, :n] = row["topk_logits"]
            topk_ids[b, :n] = row["topk_ids"]
    batch = Batch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)
    if not has_topk:
        return batch, Teacher(features=features)
    return batch, Teacher(features=features, topk_logits=topk_logits, topk_ids=topk_ids)
