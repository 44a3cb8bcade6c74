"""Timed runs: the target alone and each draft on the same prompts, in the same process.

The baseline is the shared decoder with no drafter (the same loop with k = 0), so every method pays
the same overheads. Methods run interleaved prompt by prompt, in a balanced order (``balanced_order``: each in
every place and right after every other equally often), which spreads slow drift of the machine (thermal,
other processes) and what one method leaves behind for the next evenly over them; a short untimed
warm-up per method comes first. Each generation gets a fresh ``torch.Generator`` seeded with the
same seed on the target's device, so sampled runs are reproducible. With a ``TreeSpec`` every draft
runs through the tree decoder (``decode/tree_decode.py``); the baseline stays the plain loop. A draft
that offers mirror decoding (a ``GridDrafter``) always runs through it (``decode/mirror.py``), with its
own κ and γ unless its ``Method`` names others; its own statistics ride in ``RunStats.mode``
(``eval/mirror_stats.py``).

With ``transformers_baseline`` the target's own ``transformers`` ``generate`` runs too, interleaved like
the rest, on PyTorch's stock kernels: what a user would run without draftsmith, so every speedup can
also be stated against it (``EvalResult.generate``).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from draftsmith.decode.cost_model import CostModel, TreeBudget
from draftsmith.decode.cpu_kernels import stock_kernels
from draftsmith.decode.drafter import Drafter
from draftsmith.decode.mirror import GridDrafter, MirrorResult, MirrorSettings, generate_mirror
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.speculative import GenerationResult, KPolicy, generate, sync
from draftsmith.decode.target import Target
from draftsmith.decode.tree import TreeSpec
from draftsmith.decode.tree_decode import generate_tree
from draftsmith.eval.mirror_stats import MirrorStats
from draftsmith.eval.progress import EvalProgress
from draftsmith.eval.prompts import EvalPrompt, answer_text, render
from draftsmith.eval.stats import RunStats

BASELINE = "target alone"
GENERATE = "transformers generate"
"""The user's baseline: the target's own ``generate`` (``Method.engine == "transformers"``)."""
WARMUP_TOKENS = 32
"""New tokens per warm-up generation: enough to run prefill, drafting and verify a few times."""


@dataclass
class MethodResult:
    """What one method (the baseline or a draft) did over all prompts."""

    name: str
    total: RunStats = field(default_factory=RunStats)
    categories: dict[str, RunStats] = field(default_factory=dict)
    outputs: list[list[list[int]]] = field(default_factory=list)
    """``outputs[prompt][turn]``: the generated token ids."""
    exact_match: bool | None = None
    """Greedy only: every output equals the baseline's token for token (None when sampling)."""
    category_exact: dict[str, bool | None] = field(default_factory=dict)
    mismatched_prompts: list[str] = field(default_factory=list)
    truncated: int = 0
    """Generations whose prompt did not fit the target's context and lost its first tokens (--truncate-prompts)."""
    chosen_k: Counter[int] = field(default_factory=Counter)
    """``k = "auto"`` only: verify steps per k the cost model chose (0 = a plain decoding step)."""
    policy: object = None
    """The k policy (or tree budget) the method ran with: a ``CostModel`` holds what it learnt."""
    decoding: str = "chain"
    """``Method.decoding``: "chain", "tree" or "mirror" (the report's speedup bound is for chains)."""

    def record(self, category: str, stats: RunStats, outputs: list[list[int]]) -> None:
        self.total = self.total + stats
        self.categories[category] = self.categories.get(category, RunStats()) + stats
        self.outputs.append(outputs)


@dataclass
class EvalResult:
    baseline: MethodResult
    drafts: list[MethodResult]
    categories: list[str]
    """In order of first appearance among the prompts."""
    greedy: bool
    generate: MethodResult | None = None
    """transformers' own ``generate`` on the same prompts (``evaluate(transformers_baseline=True)``)."""


@dataclass(frozen=True)
class GenerationSettings:
    """What every method of one evaluation shares: the budget per turn, the sampling and its seed, and the
    largest k a cost model may pick."""

    max_new_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    seed: int = 0
    """Each generation draws from a fresh ``torch.Generator`` seeded with it."""
    k_max: int = 8


@dataclass
class Method:
    """One way of decoding the prompts: a drafter with its k policy or tree shape (None: ``evaluate``'s)."""

    name: str
    drafter: Drafter | None
    k: KPolicy | None = None
    """Draft tokens per step, ``"auto"`` (a cost model that learns over the timed prompts), or None."""
    tree: TreeSpec | TreeBudget | None = None
    """Draft token trees of this shape (or a node budget chosen per step) instead of k-token chains."""
    mirror: MirrorSettings | None = None
    """A mirror draft's κ and γ, when not the ones it was trained with (its early-exit layer is fixed)."""
    engine: str = "draftsmith"
    """"draftsmith": the shared decoder; "transformers": the target's own ``generate`` (no drafter)."""

    def fresh(self, k_max: int) -> Method:
        """This method as a run starts it: a new cost model / tree budget for adaptive ones."""
        k = CostModel(k_max=k_max) if self.k == "auto" else self.k
        tree = copy.deepcopy(self.tree) if isinstance(self.tree, TreeBudget) else self.tree
        return replace(self, k=k, tree=tree)

    @property
    def decoding(self) -> str:
        """How it decodes, as ``_generate`` picks: "mirror" (a drafter that offers mirror decoding, a
        ``GridDrafter``), "tree" (with a tree) or "chain"."""
        if self.engine == "transformers":
            return "generate"
        if isinstance(self.drafter, GridDrafter):
            return MirrorStats.key
        return "tree" if self.drafter is not None and self.tree is not None else "chain"

    @property
    def adaptive(self) -> bool:
        return self.drafter is not None and (
            self.k == "auto" if self.tree is None else isinstance(self.tree, TreeBudget)
        )


def run_prompt(
    target: Target,
    method: Method,
    prompt: EvalPrompt,
    settings: GenerationSettings,
    chosen_k: Counter[int] | None = None,
    truncated: list[int] | None = None,
) -> tuple[list[list[int]], RunStats]:
    """Generate an answer to every turn of ``prompt``; turn i+1 sees the method's own answer to turn i.

    ``method`` as a run holds it (``Method.fresh``: a live cost model or tree budget). ``chosen_k``
    (optional) counts the k (or tree budget) used at each verify step. With ``truncated`` (a one-item
    counter), a rendered turn that does not fit the target's context keeps its last tokens and is counted;
    without it, such a turn is refused (``Target.check_fits``).
    """
    generator = torch.Generator(device=target.device).manual_seed(settings.seed)
    conversation: list[dict[str, str]] = []
    outputs: list[list[int]] = []
    stats = RunStats()
    for turn in prompt.turns:
        conversation.append({"role": "user", "content": turn})
        ids = render(target.tokenizer, conversation)
        if truncated is not None:
            ids, cut = keep_last(target, ids, settings.max_new_tokens)
            truncated[0] += cut
        result = _generate(target, ids, method, settings, generator)
        outputs.append(result.tokens)
        stats = stats + run_stats(result)
        if chosen_k is not None:
            chosen_k.update(result.chosen_k)
        conversation.append({"role": "assistant", "content": answer_text(target.tokenizer, result.tokens)})
    return outputs, stats


def keep_last(target: Target, ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, int]:
    """``ids`` cut to their last tokens if, with ``max_new_tokens`` more, they would not fit the target's
    context (``--truncate-prompts``); and 1 if cut, else 0."""
    room = (target.context_length or 0) - max_new_tokens
    if target.context_length and ids.shape[0] > room:
        return ids[-max(room, 1) :], 1
    return ids, 0


def _generate(
    target: Target, ids: torch.Tensor, method: Method, settings: GenerationSettings, generator
) -> GenerationResult:
    drafter, new, sampling = method.drafter, settings.max_new_tokens, settings.sampling
    decoding = method.decoding
    if decoding == "generate":
        return transformers_generate(target, ids, new, sampling, generator)
    if decoding == MirrorStats.key:
        return generate_mirror(target, ids, drafter, method.mirror, new, sampling, generator)
    if decoding == "tree":
        return generate_tree(target, ids, drafter, method.tree, new, sampling, generator)
    return generate(target, ids, drafter, method.k, new, sampling, generator)


def transformers_generate(
    target: Target, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling, generator: torch.Generator
) -> GenerationResult:
    """The target's own ``model.generate`` on ``ids``, on PyTorch's stock kernels, stopping after the target's
    EOS tokens as draftsmith's decoder does; timed as a whole (its prefill is not timed apart). Sampled runs
    seed torch's global generator from ``generator``'s seed (``generate`` takes no generator)."""
    eos = sorted(target.eos_ids)
    prompt = ids.view(1, -1).to(target.device)
    target.check_fits(prompt.shape[1], max_new_tokens)
    options: dict = {"do_sample": False}
    if not sampling.greedy:
        torch.manual_seed(generator.initial_seed())
        options = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None,
                   "top_p": sampling.top_p}  # fmt: skip
    with stock_kernels(target.model), torch.inference_mode():
        start = time.perf_counter()
        out = target.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **options,
        )
        sync(target.device)
        seconds = time.perf_counter() - start
    tokens = out[0, prompt.shape[1] :].tolist()
    return GenerationResult(tokens=tokens, target_forwards=len(tokens), seconds=seconds)


def run_stats(result: GenerationResult) -> RunStats:
    """A generation's statistics, with its decoding mode's own (mirror decoding's branch reuse and part times)."""
    return RunStats.from_result(
        result, MirrorStats.from_result(result) if isinstance(result, MirrorResult) else None
    )


def warm_up(
    target: Target,
    methods: Sequence[Method],
    prompts: Sequence[EvalPrompt],
    settings: GenerationSettings,
    truncate_prompts: bool = False,
) -> None:
    """One short untimed generation per method and prompt (first turn only): kernels, caches, allocator.
    Adaptive methods warm up on throwaway cost models, so timing starts without what they learnt here.
    With ``truncate_prompts`` a prompt too long for the context keeps its last tokens, as in the timed run."""
    short = replace(settings, max_new_tokens=min(settings.max_new_tokens, WARMUP_TOKENS))
    for prompt in prompts:
        ids = render(target.tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        if truncate_prompts:
            ids, _ = keep_last(target, ids, short.max_new_tokens)
        for method in methods:
            generator = torch.Generator(device=target.device).manual_seed(settings.seed)
            _generate(target, ids, method.fresh(settings.k_max), short, generator)


def static_cache_length(
    target: Target, prompts: Sequence[EvalPrompt], max_new_tokens: int, k_max: int
) -> int:
    """Positions a static KV cache needs for every conversation of ``prompts``: each turn rendered alone
    (an upper bound on what it adds, template included) plus its answer, plus one verify pass of k_max + 1."""
    longest = 0
    for prompt in prompts:
        turns = [len(render(target.tokenizer, [{"role": "user", "content": turn}])) for turn in prompt.turns]
        longest = max(longest, sum(turns) + len(turns) * (max_new_tokens + 8))
    return longest + k_max + 1


def use_static_caches(
    target: Target,
    drafters: Sequence[Drafter],
    prompts: Sequence[EvalPrompt],
    max_new_tokens: int,
    k_max: int,
    compile_mode: str = "off",
) -> None:
    """A static KV cache sized for ``prompts`` on the target and on every drafter with a cache of its own
    (causal-LM drafts; EAGLE and Medusa heads stay eager), each compiled unless ``compile_mode`` is
    ``"off"`` (``"default"``: torch.compile's default mode; ``"reduce-overhead"`` adds CUDA graphs)."""
    length = static_cache_length(target, prompts, max_new_tokens, k_max)
    mode = None if compile_mode == "default" else compile_mode
    for model in [target, *(d for d in drafters if hasattr(d, "use_static_cache"))]:
        model.use_static_cache(length)
        if compile_mode != "off":
            model.compile(mode)


def check_context(target: Target, prompts: Sequence[EvalPrompt], max_new_tokens: int) -> None:
    """Refuse, before anything runs, prompts whose conversation can need more positions than the target
    has: each turn rendered alone plus its answer (the bound ``static_cache_length`` uses)."""
    ctx = target.context_length
    if ctx is None:
        return
    too_long = []
    for prompt in prompts:
        turns = [len(render(target.tokenizer, [{"role": "user", "content": t}])) for t in prompt.turns]
        need = (
            turns[0] + max_new_tokens if len(turns) == 1 else sum(turns) + len(turns) * (max_new_tokens + 8)
        )
        if need > ctx:
            too_long.append(f"{prompt.id} (up to {need})")
    if too_long:
        shown = ", ".join(too_long[:5]) + (f" and {len(too_long) - 5} more" if len(too_long) > 5 else "")
        raise ValueError(
            f"{len(too_long)} prompt(s) can need more positions than the {ctx} that {target.name} was built for "
            f"(max_position_embeddings), with {max_new_tokens} new tokens per turn: {shown}. Nothing was run. "
            "Lower --max-new-tokens, leave those prompts out (--limit, --categories), or pass --truncate-prompts "
            "to keep the last tokens of a prompt that does not fit (counted in the report)."
        )


def evaluate(
    target: Target,
    drafts: Sequence[tuple[str, Drafter] | Method],
    prompts: Sequence[EvalPrompt],
    k: KPolicy = 5,
    max_new_tokens: int = 256,
    sampling: Sampling | None = None,
    seed: int = 0,
    warmup: int = 1,
    progress: bool | None = None,
    tree: TreeSpec | TreeBudget | None = None,
    k_max: int = 8,
    truncate_prompts: bool = False,
    transformers_baseline: bool = False,
) -> EvalResult:
    """Run the target alone and every method over ``prompts``; compare outputs when greedy.

    ``drafts``: ``(name, drafter)`` pairs, which decode with ``k`` / ``tree``, or ``Method``s with their own
    (a benchmark of several k for one drafter passes one Method per k). ``sampling``: greedy when None.
    ``progress``: show a tqdm bar (None = a bar when stderr is a terminal, else a line now and then:
    ``eval/progress.py``). ``tree``: draft token trees of this shape (every drafter must support it)
    instead of k-token chains. ``k="auto"``: each method gets
    one cost model (``decode/cost_model.py``, k in 0..``k_max``) that learns from a fresh start over the
    timed prompts and keeps what it learned from prompt to prompt; the warm-up runs on throwaway models.
    A ``TreeBudget`` as ``tree`` works the same way: each method gets its own copy, which picks the tree's
    node budget per step. A prompt that does not fit the target's context is refused before anything
    runs (``check_context``), unless ``truncate_prompts``: then it keeps its last tokens, counted in each
    method's ``truncated``. ``transformers_baseline``: also run the target's own ``generate`` (stock
    kernels), interleaved with the rest, as ``EvalResult.generate``.
    """
    settings = GenerationSettings(
        max_new_tokens, sampling if sampling is not None else Sampling(), seed, k_max
    )
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    drafted = [
        replace(d, k=k if d.k is None else d.k, tree=tree if d.tree is None else d.tree)
        if isinstance(d, Method)
        else Method(d[0], d[1], k, tree)
        for d in drafts
    ]
    for m in drafted:
        if m.k != "auto" and not isinstance(m.k, CostModel) and (not isinstance(m.k, int) or m.k < 1):
            raise ValueError(
                f"--k must be at least 1 (draft tokens per step) or 'auto', got {m.k!r} for {m.name}"
            )
    mirrored = [m.name for m in drafted if m.tree is not None and m.decoding == MirrorStats.key]
    if mirrored:
        raise ValueError(
            f"--tree asked for, but draft(s) {', '.join(mirrored)} are mirror drafts, which decode by mirror "
            "decoding (their own branch grid); evaluate them in a separate run without --tree"
        )
    chain_only = [m.name for m in drafted if m.tree is not None and not m.drafter.supports_tree]
    if chain_only:
        raise ValueError(
            f"--tree asked for, but draft(s) {', '.join(chain_only)} draft chains only; "
            "evaluate them in a separate run without --tree"
        )
    if not truncate_prompts:
        check_context(target, prompts, max_new_tokens)
    users = [Method(GENERATE, None, 0, engine="transformers")] if transformers_baseline else []
    methods = [Method(BASELINE, None, 0), *users, *drafted]
    results = [MethodResult(m.name, decoding=m.decoding) for m in methods]
    warm_up(target, methods, prompts[: max(warmup, 0)], settings, truncate_prompts)
    runs = [m.fresh(k_max) for m in methods]
    for result, method in zip(results, runs):
        result.policy = method.tree if isinstance(method.tree, TreeBudget) else method.k

    shown = EvalProgress(len(prompts), progress)
    for i, prompt in enumerate(prompts):
        for j in balanced_order(len(methods), i):
            method, running, result = methods[j], runs[j], results[j]
            chosen = result.chosen_k if method.adaptive else None  # asked of the method as given: "auto"
            cut = [0] if truncate_prompts else None
            outputs, stats = run_prompt(target, running, prompt, settings, chosen, cut)
            result.record(prompt.category, stats, outputs)
            result.truncated += cut[0] if cut else 0
        shown.update(results)
    shown.close()

    categories = list(dict.fromkeys(p.category for p in prompts))
    if settings.sampling.greedy:
        for result in results[1:]:
            compare_outputs(results[0], result, prompts)
    generated = results[1] if users else None
    drafts_done = results[1 + len(users) :]
    return EvalResult(results[0], drafts_done, categories, settings.sampling.greedy, generated)


def balanced_order(n: int, i: int) -> list[int]:
    """The order of ``n`` decoders on prompt ``i``: a Williams design (a balanced Latin square), so over ``n``
    prompts (``2n`` for odd ``n``) each decoder runs in every place and right after every other one equally
    often. A plain rotation moves the places but keeps every decoder right after the same one, whose
    after-effects (caches, the CPU's clocks, what a server left running) it then always pays."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    row = i if n % 2 == 0 else i // 2
    order = [(j + row) % n for j in first]
    return order[::-1] if n % 2 and i % 2 else order


def compare_outputs(baseline: MethodResult, result: MethodResult, prompts: Sequence[EvalPrompt]) -> None:
    """Fill ``result``'s exact-match fields: token-for-token equality with the baseline, overall and per category."""
    category_exact: dict[str, bool] = {}
    for prompt, ours, theirs in zip(prompts, result.outputs, baseline.outputs):
        same = ours == theirs
        category_exact[prompt.category] = category_exact.get(prompt.category, True) and same
        if not same:
            result.mismatched_prompts.append(prompt.id)
    result.category_exact = dict(category_exact)
    result.exact_match = not result.mismatched_prompts
