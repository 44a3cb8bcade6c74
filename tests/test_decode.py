"""The shared decoder on tiny random targets: lossless greedy, cache rollback, stopping, bad drafts."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, tiny_model, tiny_target, tiny_tokenizer

from draftsmith.decode.sampling import Sampling
from draftsmith.decode.speculative import generate
from draftsmith.decode.target import Target, load_target
from draftsmith.drafts import build_drafter
from draftsmith.drafts.model_drafter import ModelDrafter

PROMPT_LEN, NEW = 24, 48  # longer than the tiny models' sliding window (16)


def prompt(seed: int = 0) -> torch.Tensor:
    # a repeated fragment gives the n-gram drafter something to find
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(0, 250, (PROMPT_LEN // 2,), generator=g)
    return torch.cat([half, half])


def no_eos(target: Target) -> Target:
    target.eos_ids = set()
    return target


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft", ["ngram", "layers:2", "model"])
def test_greedy_speculative_equals_target_greedy(arch, draft, tmp_path):
    target = no_eos(tiny_target(arch))
    if draft == "model":  # an independent draft: another random model of the same family, saved to disk
        for seed, folder in ((0, tmp_path / "target"), (1, tmp_path / "draft")):
            tiny_model(arch, seed=seed).save_pretrained(folder)
            tiny_tokenizer().save_pretrained(folder)
        target = no_eos(load_target(str(tmp_path / "target")))
        draft = str(tmp_path / "draft")
    baseline = generate(target, prompt(), None, max_new_tokens=NEW)
    for k in (1, 4):
        result = generate(target, prompt(), build_drafter(draft, target), k=k, max_new_tokens=NEW)
        assert result.tokens == baseline.tokens, f"{arch} {draft} k={k}"
        assert len(result.tokens) == NEW


def test_draft_equal_to_target_is_always_accepted():
    target = no_eos(tiny_target("llama"))
    k = 4
    result = generate(target, prompt(), build_drafter("layers:4", target), k=k, max_new_tokens=NEW)
    assert result.accepted == result.proposed
    # τ = k + 1 on every step but the last, which is cut to the token budget
    assert all(p == k for p in result.proposed[:-1])
    assert len(result.accepted) == -(-(NEW - 1) // (k + 1))


class DisagreeingDrafter(ModelDrafter):
    """Proposes, at every position, a token the target would not choose (its argmax + 1)."""

    def propose(self, tokens, k, sampling, generator):
        proposal = super().propose(tokens, k, sampling, generator)
        proposal.tokens = (proposal.tokens + 1) % self.model.config.vocab_size
        return proposal


def test_draft_that_never_agrees_gives_tau_one():
    target = no_eos(tiny_target("llama"))
    from draftsmith.drafts.layer_subset import layer_subset_view

    drafter = DisagreeingDrafter(layer_subset_view(target.model, 4), name="anti")
    baseline = generate(target, prompt(), None, max_new_tokens=NEW)
    result = generate(target, prompt(), drafter, k=3, max_new_tokens=NEW)
    assert result.tokens == baseline.tokens
    assert sum(result.accepted) == 0 and sum(result.proposed) > 0
    assert result.target_forwards == NEW  # one token per target forward: τ = 1


def test_prefix_is_never_recomputed():
    """Every target forward sees only new positions: the inputs add up to prompt + (1 + drafts) per step."""
    target = no_eos(tiny_target("qwen2"))
    seen: list[int] = []
    target.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    result = generate(target, prompt(), build_drafter("ngram", target), k=3, max_new_tokens=NEW)
    assert sum(result.proposed) > 0
    assert seen == [PROMPT_LEN] + [1 + p for p in result.proposed]
    assert target.length == PROMPT_LEN + len(result.tokens) - 1


def test_stops_at_eos_and_at_max_new_tokens():
    target = tiny_target("llama")
    free = generate(no_eos(tiny_target("llama")), prompt(), None, max_new_tokens=NEW)
    eos = free.tokens[10]
    target.eos_ids = {eos}
    result = generate(target, prompt(), build_drafter("ngram", target), k=4, max_new_tokens=NEW)
    cut = free.tokens.index(eos) + 1
    assert result.tokens == free.tokens[:cut] and result.stopped_by == "eos"
    for budget in (1, 2, 7):
        short = generate(
            no_eos(target), prompt(), build_drafter("layers:4", target), k=5, max_new_tokens=budget
        )
        assert short.tokens == free.tokens[:budget]


def test_sampling_runs_and_is_reproducible():
    target = no_eos(tiny_target("llama"))
    sampling = Sampling(temperature=0.8, top_k=50, top_p=0.95)
    runs = []
    for _ in range(2):
        drafter = build_drafter("layers:2", target)
        g = torch.Generator().manual_seed(7)
        runs.append(
            generate(target, prompt(), drafter, k=3, max_new_tokens=NEW, sampling=sampling, generator=g)
        )
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == NEW


def test_bfloat16_target_decodes():
    target = Target(tiny_model("llama").to(torch.bfloat16), tiny_tokenizer(), "tiny-bf16")
    no_eos(target)
    result = generate(target, prompt(), build_drafter("layers:2", target), k=3, max_new_tokens=16)
    assert len(result.tokens) == 16


def test_draft_with_other_vocabulary_is_a_clear_error(tmp_path):
    target = tiny_target("llama")
    tiny_model("llama", vocab_size=300).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 300 logits .* has 259"):
        build_drafter(str(tmp_path), target)


def test_draft_with_other_tokenizer_is_a_clear_error(tmp_path):
    target = tiny_target("llama")
    tiny_model("llama").save_pretrained(tmp_path)
    other = tiny_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|other|>"]})  # a different id → token map
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizers with different vocabularies"):
        build_drafter(str(tmp_path), target)


def test_bad_layer_count_is_a_clear_error():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="has 4 decoder layers"):
        build_drafter("layers:9", target)
    with pytest.raises(ValueError, match="needs a layer count"):
        build_drafter("layers:x", target)
