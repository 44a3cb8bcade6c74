"""A real llama.cpp, run for real: find the optional build and drive ``llama-server`` over HTTP.

The build comes from ``scripts/install_llamacpp.sh`` (llama.cpp's MIT source as vendored in the PyPI
sdist of llama-cpp-python, built into the draftsmith cache). ``DRAFTSMITH_LLAMACPP`` points at another
``build/bin`` folder. Nothing here is needed to train, decode or export; tests that need it skip
without it. Reading llama.cpp's own acceptance from the server's trace is ``bench/benchlib/llamacpp_runs.py``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.servers import LocalServer

LLAMACPP_PY_VERSION = "0.3.36"
INSTALL = "bash scripts/install_llamacpp.sh"


def cpu_args() -> list[str]:
    """Flags this CPU needs: on a CPU with AMX, llama.cpp's AMX matrix kernels (weights repacked at load)
    crash with a segmentation fault in ``ggml_backend_amx_mul_mat`` on the bundled Q4_1 target
    (ggml-org/llama.cpp#20824, open); ``--no-repack`` keeps the weights in their own layout."""
    from draftsmith.loading import cpu_flags

    return ["--no-repack"] if "amx_int8" in cpu_flags() or "amx_tile" in cpu_flags() else []


def bin_dir() -> Path:
    """Where the llama.cpp tools are: $DRAFTSMITH_LLAMACPP, else the install script's folder in the cache."""
    if os.environ.get("DRAFTSMITH_LLAMACPP"):
        return Path(os.environ["DRAFTSMITH_LLAMACPP"])
    cache = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
    return cache / "llama.cpp" / f"llama-cpp-python-{LLAMACPP_PY_VERSION}" / "build" / "bin"


def tool(name: str) -> Path:
    """The path of a built llama.cpp tool (``llama-server``, ...); a clear error naming the install command."""
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(
            f"llama.cpp's {name} is not built here ({path}). It is an optional extra: run `{INSTALL}` from a "
            "draftsmith checkout (cmake and a C++ compiler), or set DRAFTSMITH_LLAMACPP "
            "to the build/bin folder of a llama.cpp build."
        )
    return path


def available(name: str = "llama-server") -> bool:
    try:
        tool(name)
    except FileNotFoundError:
        return False
    return True


class Server(LocalServer):
    """``llama-server`` on a free local port for the length of a ``with`` block.

    ``args`` are llama-server's own flags after ``-m MODEL`` (``--spec-type draft-eagle3|draft-dflash
    --spec-draft-model HEAD.gguf``, ``-c 4096``, ...). The server's log goes to ``log`` (or is discarded);
    with ``log`` the server also logs every verify step ("accepted a/p draft tokens", LLAMA_TRACE=1).
    """

    title = "llama-server"

    def __init__(self, model: str | Path, args: list[str] | None = None, threads: int | None = None,
                 log: str | Path | None = None, start_timeout: float = 120.0):  # fmt: skip
        super().__init__(log, start_timeout)
        self.model, self.args = Path(model), list(args or [])
        self.threads = threads or os.cpu_count() or 1

    def command(self) -> list[str]:
        return [
            str(tool("llama-server")), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(self.threads), "-tb", str(self.threads), "--no-ui", "-np", "1", *cpu_args(), *self.args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str] | None:
        return {**os.environ, "LLAMA_TRACE": "1"} if self.log else None

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """llama.cpp's tokenization of ``text`` (special tokens parsed; no BOS added)."""
        return self.post("/tokenize", {"content": text, "add_special": False, "parse_special": special})[
            "tokens"
        ]

    def detokenize(self, tokens: list[int]) -> str:
        return self.post("/detokenize", {"tokens": list(tokens)})["content"]

    def complete(self, tokens: list[int], n_predict: int, **params) -> dict:
        """Greedy ``/completion`` from token ids: returns llama.cpp's JSON (``tokens``, ``timings`` with
        ``draft_n`` / ``draft_n_accepted`` when it speculated, ``predicted_per_second``)."""
        body = {
            "prompt": list(tokens),
            "n_predict": n_predict,
            "temperature": 0.0,
            "top_k": 1,
            "samplers": ["top_k"],
            "cache_prompt": False,
            "return_tokens": True,
            **params,
        }
        return self.post("/completion", body)


def speculative_args(kind: str | None, k: int, draft: str | Path | None = None) -> list[str]:
    """llama-server flags for greedy decoding with up to ``k`` draft tokens a step.

    ``kind``: None (the target alone), ``"ngram"`` (ngram-simple, N = 3, M = k), ``"eagle3"`` (an EAGLE-3
    head GGUF, draft-eagle3), ``"dflash"`` (a DFlash draft GGUF, draft-dflash: llama.cpp decodes a block of
    k + 1 tokens, clamped to the draft's block size; k = block size - 1 is the block it was trained on) or
    ``"draft"`` (a small causal LM GGUF, draft-simple); ``draft`` is the GGUF.
    ``--spec-draft-p-min 0`` keeps every proposal, as draftsmith's chain decoder does.
    """
    if kind is None:
        return ["-c", "4096", "--log-colors", "off"]
    common = ["-c", "4096", "--spec-draft-n-max", str(k), "--spec-draft-p-min", "0", "--log-colors", "off"]
    if kind == "ngram":
        return [*common, "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                "--spec-ngram-simple-size-m", str(k), "--spec-ngram-simple-min-hits", "1"]  # fmt: skip
    spec_types = {"eagle3": "draft-eagle3", "dflash": "draft-dflash", "draft": "draft-simple"}
    if kind not in spec_types:
        raise ValueError(
            f"unknown llama.cpp draft kind {kind!r}: None, 'ngram', {', '.join(map(repr, spec_types))}"
        )
    if draft is None:
        raise ValueError(f"a {kind} draft needs its GGUF file")
    return [*common, "--spec-type", spec_types[kind], "--spec-draft-model", str(draft)]
