"""Offline mode, the reading side: a feature cache (``train/feature_cache.py``'s layout) as a dataset of
unpadded examples, and their collation into the (Batch, Teacher) a training step takes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.train.feature_cache import DTYPE_NAMES, FP8, MANIFEST, from_fp8, shard_path, stored_topk
from draftsmith.train.objective import Batch, Teacher


class FeatureCache(torch.utils.data.Dataset):
    """Read a cache back: item i is one example's tokens and teacher outputs (unpadded tensors)."""

    def __init__(self, directory: str | Path):
        """``topk`` is the logits each item holds (0 in a ``final_state`` cache, whose ``features`` hold the
        last layer's output as well: ``teacher_from_final_state`` turns them into the logits cache's)."""
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not path.exists():
            raise FileNotFoundError(
                f"{self.directory} is not a feature cache (no {MANIFEST}); build it first"
            )
        self.manifest = json.loads(path.read_text())
        self.layers = [int(i) for i in self.manifest["layers"]]
        self.topk = stored_topk(self.manifest)
        self.teacher = self.manifest.get("teacher", "logits")
        self.full_logits = bool(self.manifest.get("full_logits", False))
        self.target_dtype = getattr(torch, self.manifest["target_dtype"])
        self.fp8 = self.manifest.get("feature_dtype") == DTYPE_NAMES[FP8]
        per_shard = int(self.manifest["examples_per_shard"])
        n = int(self.manifest["num_examples"])
        self._offsets: list[torch.Tensor] = []
        for shard in range((n + per_shard - 1) // per_shard):
            path = shard_path(self.directory, shard)
            if not path.exists():
                raise FileNotFoundError(
                    f"feature cache {self.directory} is incomplete: {path.name} is missing; rebuild it"
                )
            with safe_open(str(path), "pt") as f:
                self._offsets.append(f.get_tensor("offsets"))
        self._per_shard = per_shard
        self._len = n
        self._handles: dict[int, object] = {}  # opened lazily: safe_open handles do not pickle to workers

    def __len__(self) -> int:
        return self._len

    @property
    def shard_sizes(self) -> list[int]:
        """Examples in each shard, in order (the by-shard training order splits shards across ranks)."""
        return [len(offsets) - 1 for offsets in self._offsets]

    def _features(self, f, layer: int, lo: int, hi: int) -> torch.Tensor:
        values = f.get_slice(f"features.{layer}")[lo:hi]
        return from_fp8(values, f.get_slice(f"features_scale.{layer}")[lo:hi]) if self.fp8 else values

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": {}}

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self._len:
            raise IndexError(index)
        shard, local = divmod(index, self._per_shard)
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(shard_path(self.directory, shard)), "pt")
        f = self._handles[shard]
        lo, hi = int(self._offsets[shard][local]), int(self._offsets[shard][local + 1])
        ids = None
        if self.topk and self.full_logits:
            ids = torch.arange(self.topk).expand(hi - lo, self.topk)
        elif self.topk:
            ids = f.get_slice("topk_ids")[lo:hi]
        row = {
            "input_ids": f.get_slice("input_ids")[lo:hi],
            "loss_mask": f.get_slice("loss_mask")[lo:hi],
            "features": {i: self._features(f, i, lo, hi) for i in self.layers},
            "topk_logits": f.get_slice("topk_logits")[lo:hi] if self.topk else None,
            "topk_ids": ids,
        }
        if "position_ids" in f.keys():  # packed rows
            row["position_ids"] = f.get_slice("position_ids")[lo:hi]
        return row


def collate_cached(
    rows: Sequence[dict], pad_id: int, dtype: torch.dtype | None = None
) -> tuple[Batch, Teacher]:
    """Right-pad cached examples into (Batch, Teacher); features cast to ``dtype`` (the target's) if given.

    Padded positions hold zeros (and pad_id tokens); they have attention_mask and loss_mask 0.
    Packed rows bring their ``position_ids`` (padding: 0), which keep their conversations apart.
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
    packed = "position_ids" in first
    position_ids = torch.zeros(bsz, width, dtype=torch.long) if packed else None
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
        if packed:
            position_ids[b, :n] = row["position_ids"]
        for i, f in row["features"].items():
            features[i][b, :n] = f
        if has_topk:
            topk_logits[b, :n] = row["topk_logits"]
            topk_ids[b, :n] = row["topk_ids"]
    batch = Batch(input_ids, attention_mask, loss_mask, position_ids)
    if not has_topk:
        return batch, Teacher(features=features)
    return batch, Teacher(features=features, topk_logits=topk_logits, topk_ids=topk_ids)
