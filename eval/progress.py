"""How an evaluation shows it is alive: a tqdm bar on a terminal; in a log file (a SLURM job's output,
stderr not a terminal) a line now and then, as a bar redrawn with carriage returns is no use there.

``eval  D/N prompts  M:SS  tok/s: target alone X, run/draft Y (τ T)``: the first prompt's line
comes at once (the run is alive and how fast it goes), then one every ``every_s`` seconds, and the last.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

LOG_EVERY_S = 30.0
"""Seconds between progress lines in a log file."""


def short_name(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1][:24]


def progress_line(done: int, total: int, elapsed_s: float, results: Sequence) -> str:
    """One line of progress over ``results`` (``MethodResult``s, the baseline first): tokens/s of each, τ of drafts."""
    minutes, seconds = divmod(int(elapsed_s), 60)
    speeds = ", ".join(
        f"{short_name(r.name)} {r.total.timing.tokens_per_s:.1f}"
        + (f" (τ {r.total.acceptance.tau:.2f})" if i else "")
        for i, r in enumerate(results)
    )
    return f"eval  {done}/{total} prompts  {minutes}:{seconds:02d}  tok/s: {speeds}"


class EvalProgress:
    """Progress over the timed prompts: a bar (``show`` True, or None on a terminal), lines now and then
    (``show`` None and stderr not a terminal), or nothing (``show`` False)."""

    def __init__(self, total: int, show: bool | None = None, every_s: float = LOG_EVERY_S, stream=None):
        self.total, self.every_s, self.stream = total, every_s, stream or sys.stderr
        self.lines = show is None and not getattr(self.stream, "isatty", lambda: False)()
        self.bar = None if self.lines or show is False else tqdm(total=total, desc="eval", unit="prompt")
        self.start = self.last = time.monotonic()
        self.done = 0

    def update(self, results: Sequence) -> None:
        """One more prompt done by every method of ``results`` (the baseline first)."""
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            if len(results) > 1:
                self.bar.set_postfix_str(
                    " ".join(f"{short_name(r.name)} τ={r.total.acceptance.tau:.2f}" for r in results[1:])
                )
            return
        now = time.monotonic()
        if self.lines and (self.done in (1, self.total) or now - self.last >= self.every_s):
            self.last = now
            print(
                progress_line(self.done, self.total, now - self.start, results), file=self.stream, flush=True
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
