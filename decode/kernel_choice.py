"""The CPU kernels for decoding, chosen by measuring them on this machine and this target.

oneDNN on prepacked weights (``decode/cpu_kernels.py``) reads the weights of a few-row product at close
to memory speed on the CPU it was written for, and is slower than PyTorch's stock kernels on a CPU with
AMX matrix units (docs/studies/decoder_speed.md, "CPU kernels"): no fixed choice is right for every CPU.
``choose_kernels`` times both on the real target, after a prefill of ``CONTEXT`` positions, for the two
product shapes decoding has: one token (plain decoding, the baseline) and a verify pass of ``width`` tokens.
Rounds alternate the kernels' order, the first ``WARMUP`` rounds are dropped and the median of the rest is
compared; each shape keeps the faster kernel, in the ``KernelPolicy`` the packed layers share. Nothing
numeric depends on the choice beyond float32 rounding: the target verifies every drafted token either way.

A choice is kept in ``$DRAFTSMITH_CACHE/kernels.json``, keyed by the machine (CPU model and matrix
flags, torch version, threads) and the target (its name and shape, dtype) and the verify width, so the
next run starts without measuring; ``remeasure=True`` measures again. The result says which kernel
each shape took, what each measured and whether it was measured now or read from the cache.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from draftsmith import files
from draftsmith.decode.cpu_kernels import KERNELS, KernelPolicy
from draftsmith.decode.target import Target

CONTEXT = 128
"""Positions cached before the timed steps: a short conversation's worth, so attention is not empty."""
WARMUP = 2
ROUNDS = 8
CACHE_NAME = "kernels.json"


def machine_key() -> str:
    """What makes timings comparable: CPU model and matrix flags, torch version, threads."""
    from draftsmith.loading import cpu_flags, cpu_model

    flags = ",".join(
        sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16", "avx512f", "avx2")))
    )
    return f"{cpu_model()} [{flags}] torch {torch.__version__} threads {torch.get_num_threads()}"


def cache_path() -> Path:
    from draftsmith.loading import cache_dir

    return cache_dir() / CACHE_NAME


@torch.inference_mode()
def measure(
    target: Target, policy: KernelPolicy, width: int, rounds: int = ROUNDS
) -> dict[str, dict[str, float]]:
    """Median milliseconds of a target forward of 1 and of ``width`` tokens after ``CONTEXT`` cached
    positions, per kernel: ``{"plain": {"packed": ms, "stock": ms}, "verify": {...}}``."""
    from draftsmith.decode.speculative import sync

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (CONTEXT + width,), generator=gen).to(target.device)
    target.reset()
    target.forward(ids[:CONTEXT])
    shapes = {"plain": 1, "verify": width}
    times: dict[str, dict[str, list[float]]] = {s: {k: [] for k in KERNELS} for s in shapes}
    for r in range(WARMUP + rounds):
        for kernel in KERNELS if r % 2 == 0 else KERNELS[::-1]:
            with policy.forced(kernel):
                for shape, n in shapes.items():
                    start = time.perf_counter()
                    target.forward(ids[CONTEXT : CONTEXT + n])
                    sync(target.device)
                    elapsed = time.perf_counter() - start
                    target.rollback(CONTEXT)
                    if r >= WARMUP:
                        times[shape][kernel].append(1000 * elapsed)
    target.reset()
    return {s: {k: statistics.median(v) for k, v in per.items()} for s, per in times.items()}


def choose_kernels(
    target: Target, policy: KernelPolicy, width: int, remeasure: bool = False, cache: Path | None = None
) -> dict:
    """Set ``policy`` to the faster kernel for a plain step and for a verify pass of ``width`` tokens on
    ``target`` (its linears already packed with ``policy``); what was chosen, from what timings and
    whether they were measured now (``"source": "measured"``) or read from the cache (``"cached"``)."""
    if width < 1:
        raise ValueError(f"the verify width must be at least 1 token, got {width}")
    cache = cache_path() if cache is None else cache
    shape = target.record()
    key = (
        f"{machine_key()} | {shape['name']} {shape['model_type']} {shape['hidden_size']}x"
        f"{shape['num_hidden_layers']} vocab {shape['vocab_size']} {target.dtype} | width {width}"
    )
    known = _read(cache)
    if key in known and not remeasure:
        record = {**known[key], "source": "cached"}
    else:
        timings = measure(target, policy, width)
        record = {
            "plain": min(KERNELS, key=lambda k: timings["plain"][k]),
            "verify": min(KERNELS, key=lambda k: timings["verify"][k]),
            "ms": timings,
            "width": width,
            "context": CONTEXT,
            "date": time.strftime("%Y-%m-%d"),
        }
        known[key] = record
        try:
            files.write_text(cache, json.dumps(known, indent=1) + "\n")
        except OSError as err:  # a read-only cache costs the next run a measurement, nothing else
            print(f"kernels: could not keep the choice in {cache} ({err.strerror}); it is measured each run")
        record = {**record, "source": "measured"}
    policy.plain, policy.verify = record["plain"], record["verify"]
    return {"mode": "auto", **record, "cache": str(cache)}


def _read(cache: Path) -> dict:
    try:
        known = json.loads(cache.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):  # a damaged cache is measured over, not trusted
        return {}
    return known if isinstance(known, dict) else {}


def describe(choice: dict) -> str:
    """One line for the terminal: what each shape runs on, and the timings it was chosen by."""
    if choice.get("mode") != "auto" or "ms" not in choice:
        note = f" ({choice['note']})" if "note" in choice else " (forced by --cpu-kernels)"
        return f"kernels: plain {choice['plain']}, verify {choice['verify']}{note}"
    ms = choice["ms"]
    parts = [
        f"{shape} ({n} token{'s' if n > 1 else ''}) {choice[shape]}: "
        + ", ".join(f"{k} {ms[shape][k]:.1f} ms" for k in KERNELS)
        for shape, n in (("plain", 1), ("verify", choice["width"]))
    ]
    return f"kernels ({choice['source']}): " + "; ".join(parts)
