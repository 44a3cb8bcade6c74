"""Mirror decoding in eval: what it measures beyond acceptance and timing, how the report shows it, its options.

``MirrorStats`` sums the branch reuse and part times of ``MirrorResult``s (``decode/mirror.py``) over
generations; ``RunStats.mode`` carries it beside the acceptance record. The report asks it for a draft's
``mirror`` entry, its table and its lines of the metric definitions (``eval/report.py``, ``MODES``); the
eval command asks this module for the options that set κ, γ and the modelled channel.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import ClassVar

from draftsmith.decode.drafter import Drafter
from draftsmith.decode.mirror import PARTS, GridDrafter, MirrorResult, MirrorSettings
from draftsmith.eval.numbers import cell, json_number, json_ratio
from draftsmith.eval.stats import Timing

DEFAULT_CHANNEL_LATENCY_MS = 0.1
"""The modelled channel's latency per mirror step, when the settings name none: the early-exit
candidates sent to the draft's device and its branches back, two small messages (tens of µs each
between GPUs of one node)."""


@dataclass
class MirrorStats:
    """Mirror decoding's branch reuse and the time of each part of its steps, summed over generations."""

    key: ClassVar[str] = "mirror"
    """``Method.decoding`` of a mirror draft, and its entry's key in report.json."""
    no_bound: ClassVar[str] = (
        "no bound: it is for chain drafting; mirror decoding reuses branches (see modelled_speedup)"
    )
    title: ClassVar[str] = (
        "mirror decoding, ms per step measured on this device; modelled_speedup is a MODEL of two devices, "
        "not a measurement (docs/DECODING.md):"
    )
    metrics: ClassVar[str] = """\
mirror drafts (decode/mirror.py), measured on this one device: hit rate = steps whose proposal was a
          reused branch / steps that had a grid to reuse from; ms per step of each part (fresh draft on a
          miss, target up to the early exit, the early-exit LM head, target after it, the grid's
          rollouts, verify).
modelled_speedup  a MODEL, not a measurement: the same parts with the rollouts overlapping the target
          after the early exit, as on a second device, plus the channel latency per step, against the
          target alone measured here (docs/DECODING.md, "Mirror decoding")."""

    steps: int = 0
    hits: int = 0
    """Steps whose proposal was a branch of the previous step's grid."""
    reuse_chances: int = 0
    """Steps that had a previous grid to reuse from."""
    part_seconds: tuple[float, ...] = (0.0,) * len(PARTS)
    """Seconds in each of ``decode.mirror.PARTS``."""
    overlapped_seconds: float = 0.0
    """``MirrorResult.overlapped_seconds``: the modelled two-device time before the channel's."""

    @classmethod
    def from_result(cls, result: MirrorResult) -> MirrorStats:
        parts = tuple(sum(step[i] for step in result.parts) for i in range(len(PARTS)))
        return cls(len(result.parts), result.hits, result.reuse_chances, parts, result.overlapped_seconds())

    def add(self, other: MirrorStats) -> MirrorStats:
        return MirrorStats(
            self.steps + other.steps,
            self.hits + other.hits,
            self.reuse_chances + other.reuse_chances,
            tuple(a + b for a, b in zip(self.part_seconds, other.part_seconds)),
            self.overlapped_seconds + other.overlapped_seconds,
        )

    __add__ = add

    @property
    def hit_rate(self) -> float:
        return self.hits / self.reuse_chances if self.reuse_chances else math.nan

    def two_device_seconds(self, channel_latency: float) -> float:
        """MODELLED two-device wall time (``MirrorResult.two_device_seconds``), never a measurement."""
        return self.overlapped_seconds + channel_latency * self.steps

    def entry(self, timing: Timing, baseline: Timing, settings: dict) -> dict:
        """A draft's ``mirror`` entry: branch reuse and part times (measured) and its two-device speed
        (MODELLED, with ``settings``' channel latency) beside the target alone's ``baseline``."""
        latency_ms = settings.get("channel_latency_ms", DEFAULT_CHANNEL_LATENCY_MS)
        steps = max(self.steps, 1)
        modelled = timing.new_tokens / self.two_device_seconds(latency_ms / 1000)
        return {
            "branch_reuse_hit_rate": json_number(self.hit_rate),
            "hits": self.hits,
            "reuse_chances": self.reuse_chances,
            "ms_per_step": {part: 1000 * sec / steps for part, sec in zip(PARTS, self.part_seconds)},
            "channel_latency_ms": latency_ms,
            "modelled_two_device_tokens_per_s": json_number(modelled),
            "modelled_speedup": json_ratio(modelled, baseline.tokens_per_s),
        }

    @staticmethod
    def rows(report: dict) -> list[list[str]]:
        """Header + one row per mirror draft of ``report``: hit rate, ms per part, measured and modelled
        speedup; no rows when it has none."""
        rows = []
        for d in report["drafts"]:
            m = d.get(MirrorStats.key)
            if m is None:
                continue
            rows.append(
                [
                    d["name"],
                    cell(m["branch_reuse_hit_rate"], ".2f"),
                    *(cell(m["ms_per_step"][p], ".2f") for p in PARTS),
                    cell(d["speedup"], ".2f"),
                    f"{cell(m['modelled_speedup'], '.2f')} (latency {m['channel_latency_ms']:g} ms)",
                ]
            )
        header = ["draft", "hit rate", *(f"{p} ms" for p in PARTS), "measured speedup", "modelled_speedup"]
        return [header, *rows] if rows else []


# -- the eval command's options ------------------------------------------------------------------------


def add_options(parser: argparse.ArgumentParser) -> None:
    """--mirror-kappa, --mirror-gamma and --channel-latency-ms."""
    parser.add_argument(
        "--mirror-kappa",
        type=int,
        default=None,
        metavar="K",
        help="mirror drafts: early-exit candidates per verify position (default: the draft's own)",
    )
    parser.add_argument(
        "--mirror-gamma",
        type=int,
        default=None,
        metavar="G",
        help="mirror drafts: draft tokens per branch, and per fresh proposal (default: the draft's own)",
    )
    parser.add_argument(
        "--channel-latency-ms",
        type=float,
        default=DEFAULT_CHANNEL_LATENCY_MS,
        metavar="MS",
        help="mirror drafts: the channel latency per step in the MODELLED two-device speed (modelled_speedup; "
        f"default {DEFAULT_CHANNEL_LATENCY_MS:g} ms), which is reported apart from the measured speedup",
    )


def check_options(kappa: int | None, gamma: int | None, channel_latency_ms: float) -> None:
    """What can be checked of the options (``--mirror-kappa``, ``--mirror-gamma``, ``--channel-latency-ms``)
    before any model loads."""
    for flag, value in (("--mirror-kappa", kappa), ("--mirror-gamma", gamma)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if channel_latency_ms < 0:
        raise ValueError(f"--channel-latency-ms must be 0 or more, got {channel_latency_ms}")


def settings_from_options(
    drafters: list[Drafter], kappa: int | None, gamma: int | None
) -> list[MirrorSettings | None]:
    """Per drafter, the settings a mirror draft decodes with (its own, with ``kappa`` and ``gamma`` where
    given); None for the others."""
    settings = [
        replace(
            d.mirror,
            kappa=d.mirror.kappa if kappa is None else kappa,
            gamma=d.mirror.gamma if gamma is None else gamma,
        )
        if isinstance(d, GridDrafter)
        else None
        for d in drafters
    ]
    if (kappa is not None or gamma is not None) and not any(settings):
        raise ValueError(
            "--mirror-kappa / --mirror-gamma set mirror decoding, but no --draft is a mirror draft (draft.kind: mirror)"
        )
    return settings


def refuse_compile(drafts: list[tuple[str, Drafter]], compile_mode: str) -> None:
    """Mirror decoding times the target's forward with a hook, which a compiled forward does not run."""
    mirrored = [spec for spec, d in drafts if isinstance(d, GridDrafter)]
    if mirrored and compile_mode != "off":
        raise ValueError(
            f"--compile: mirror draft(s) {', '.join(mirrored)} time the target's forward at the early exit "
            "with a hook, which a compiled forward does not run; drop --compile (--static-cache alone works)"
        )
