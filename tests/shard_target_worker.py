"""One rank of the sharded-teacher test (``tests/test_shard_target.py``), started by torchrun.

    torchrun --standalone --nproc-per-node 2 tests/shard_target_worker.py ARCH tied|untied OUT

Each rank builds the same tiny random-init target, computes the teacher for its own batch (with a padded
row and a packed row), shards the target with ``shard_frozen_target``, computes the teacher again and
writes OUT/rank<r>.json: the largest differences and the parameter elements it holds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tiny import tiny_target

from draftsmith.train.infra.shard_target import is_sharded, local_parameter_count, shard_frozen_target
from draftsmith.train.objective import Batch
from draftsmith.train.teacher import compute_teacher

LAYERS = (0, 2, 3)  # low, middle and last: the taps EAGLE-3 takes


def rank_batch(rank: int, packed: bool) -> Batch:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 256, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row
    if packed:  # two conversations in each row: positions restart
        pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(3, 12).contiguous()
        return Batch(ids, mask, mask.clone(), position_ids=pos)
    return Batch(ids, mask, mask.clone())


def main(arch: str, tied: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = tiny_target(arch, tie_word_embeddings=tied == "tied")
    assert (target.model.get_output_embeddings().weight is target.model.get_input_embeddings().weight) == (
        tied == "tied"
    )
    report = {"arch": arch}
    plain = [compute_teacher(target, rank_batch(rank, p), LAYERS, topk=8) for p in (False, True)]
    shard_frozen_target(target.model, torch.device("cpu"))
    shard_frozen_target(target.model, torch.device("cpu"))  # again (each validation start): a no-op
    report["sharded"] = is_sharded(target.model)
    report["local"], report["total"] = local_parameter_count(target.model)
    # what the rank really keeps: the storages behind its local shards
    storages = {p.to_local().untyped_storage() for p in target.model.parameters()}
    report["stored_bytes"] = sum(s.nbytes() for s in {s.data_ptr(): s for s in storages}.values())
    sharded = [compute_teacher(target, rank_batch(rank, p), LAYERS, topk=8) for p in (False, True)]
    report["feature_diff"] = max(
        (a.features[i] - b.features[i]).abs().max().item() for a, b in zip(plain, sharded) for i in LAYERS
    )
    logit_diffs = [(a.topk_logits - b.topk_logits).abs().max().item() for a, b in zip(plain, sharded)]
    report["logit_diff"] = max(logit_diffs)
    report["same_ids"] = all(torch.equal(a.topk_ids, b.topk_ids) for a, b in zip(plain, sharded))
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # both reports are written: what the test reads is complete
    # Tearing gloo down aborted a rank ("terminate called without an active exception") in 1 of 12 runs on
    # 2 cores after this barrier and destroy_process_group, both reports written; leaving without the C++
    # teardown, 0 of 30 (torchrun of this worker in a loop, gemma2 tied, 2026-12-04). The test fails only
    # on what it tests.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
