"""The target: a frozen Hugging Face causal LM with a KV cache that can be rolled back.

``load_target`` takes every spec ``draftsmith.loading.load_causal_lm`` does (a Hub id or local
directory, a local ``.gguf`` file, the alias ``smollm2-135m-instruct``). Any ``AutoModelForCausalLM``
works; nothing here is architecture-specific.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from draftsmith.decode.features import capture_layers
from draftsmith.loading import eos_token_ids, load_causal_lm, load_causal_lm_skeleton, tokenizer_fingerprint

COMPILE_MAX_WIDTH = 16
"""Target.compile: decode steps of at most this many tokens run compiled (one graph per width)."""


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
    def materialized(self) -> bool:
        """False for a skeleton (``load_target_skeleton``): its layers are on the meta device and cannot run."""
        return not any(p.is_meta for p in self.model.parameters())

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


def load_target_skeleton(
    spec: str, device: str = "cpu", dtype: str = "float32", chat_template: str | None = None
) -> Target:
    """The target without its layers (``load_causal_lm_skeleton``: only the embedding, final norm and LM
    head are read, from its safetensors), for a run whose teacher outputs are all in a feature cache;
    the same record, tokenizer, shapes and dtype as ``load_target`` gives, none of its memory."""
    if chat_template is not None and not Path(chat_template).is_file():
        raise FileNotFoundError(f"chat template file {chat_template} does not exist (a Jinja template)")
    model, tokenizer, name = load_causal_lm_skeleton(spec, dtype, device)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return Target(model, tokenizer, name)
