"""Mirror decoding (decode/mirror.py) and the mirror draft kind (drafts/mirror.py): lossless, and the
hypothesis grid is what chain drafting would have drafted at each branch."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest
import torch
from tiny import ARCHS, tiny_target

import draftsmith.decode.mirror as mirror_module
from draftsmith.decode.mirror import MirrorSettings, early_exit_candidates, generate_mirror
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.speculative import generate
from draftsmith.drafts.base import draft_kind
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.mirror import MirrorDrafter
from draftsmith.train.registry import build_objective

LAYERS = 6
DRAFT_VOCAB = 120  # < 259: the grid maps draft ids to target ids


def mirror_drafter(
    target, exit_layer: int, kappa: int = 3, gamma: int = 3, seed: int = 0, vocab: list[int] | None = None
) -> MirrorDrafter:
    """A random-init mirror head; its draft vocabulary the ids ``vocab`` (default: the DRAFT_VOCAB lowest)."""
    counts = torch.arange(target.vocab_size).flip(0).float()
    if vocab is not None:
        counts = torch.zeros(target.vocab_size)
        counts[vocab] = 1
    size = DRAFT_VOCAB if vocab is None else len(vocab)
    options = {"early_exit_layer": exit_layer, "kappa": kappa, "gamma": gamma, "draft_vocab_size": size}
    objective = build_objective("mirror", target, options, counts)
    torch.manual_seed(seed)
    return MirrorDrafter(objective.build_draft().eval())


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param, layers=LAYERS)


def prompts(n: int = 3, length: int = 7):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (length,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("exit_layer", [2, LAYERS - 1], ids=["middle", "last"])
def test_greedy_mirror_decoding_is_the_target_alone(target, exit_layer):
    drafter = mirror_drafter(target, exit_layer)
    for prompt in prompts():
        alone = generate(target, prompt, None, max_new_tokens=24).tokens
        result = generate_mirror(target, prompt, drafter, max_new_tokens=24)
        assert result.tokens == alone
        assert len(result.parts) == len(result.accepted) and result.reuse_chances == len(result.parts) - 1
        if exit_layer == LAYERS - 1:
            # the "early" exit is the target's own logits: the correction is always its top candidate
            assert result.hits == result.reuse_chances


def test_the_grid_is_what_chain_drafting_would_draft_at_each_branch():
    target = tiny_target("llama", layers=LAYERS)
    layer = 3
    drafter = mirror_drafter(target, layer, kappa=2, gamma=3)
    prompt = prompts(1, 9)[0]
    committed = torch.cat([prompt, torch.tensor(generate(target, prompt, None, max_new_tokens=1).tokens)])
    target.reset()
    target.set_capture((layer,))
    step = target.forward(committed[:-1])
    drafter.begin(committed[:-1], step.features)
    drafted = torch.tensor([5, 17, 33])
    verify = target.forward(torch.cat([committed[-1:], drafted]))
    exit_hidden = verify.features[layer]
    candidates = early_exit_candidates(target, exit_hidden, 2)
    grid = drafter.rollout(committed, drafted, exit_hidden, candidates, 3, Sampling(), None)
    assert grid.tokens.shape == (4 * 2, 3)
    for r in range(grid.tokens.shape[0]):
        depth, root = int(grid.depths[r]), int(grid.roots[r])
        context = torch.cat([committed, drafted[:depth]])
        # a fresh drafter that committed the same tokens with the same layer outputs, then drafts a chain
        fresh = MirrorDrafter(drafter.head)
        target.reset()
        features = target.forward(context).features
        fresh.begin(context, features)
        chain = fresh.propose(torch.cat([context, torch.tensor([root])]), 3, Sampling(), None).tokens
        assert grid.tokens[r].tolist() == chain.tolist(), f"branch {r} (depth {depth}, root {root})"


# ---- sampling: the committed tokens keep the target's distribution ----------------------------------

LENGTH, TOP_K, SAMPLES, BOUND = 3, 3, 1500, 4.5
SAMPLING = Sampling(temperature=8.0, top_k=TOP_K)  # the tiny target's logits are sharpened x20


@pytest.fixture(scope="module", params=[3, 1], ids=["exit-last", "exit-middle"])
def sampling_setup(request):
    """Exit at the last layer: every correction is a candidate, so every step after the first reuses a
    branch; exit in the middle: hits and misses mix. The draft's vocabulary is the tokens the target can
    sample here, so its random proposals are accepted now and then (reused branches too)."""
    target = tiny_target("llama", layers=4)
    target.eos_ids = set()  # every sample is LENGTH tokens long
    prompt = prompts(1, 5)[0]
    exact = exact_distribution(target, prompt)
    support = sorted({tok for seq in exact for tok in seq})
    drafter = mirror_drafter(target, exit_layer=request.param, kappa=TOP_K, gamma=2, seed=1, vocab=support)
    return target, drafter, prompt, exact


def exact_distribution(target, prompt) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) of the target alone under SAMPLING, by enumerating the top-k supports."""
    from draftsmith.decode.sampling import to_probs

    def next_probs(tokens):
        target.reset()
        return to_probs(target.forward(torch.tensor(tokens)).logits[-1], SAMPLING)

    probs = {}
    frontier = [((), 1.0)]
    for _ in range(LENGTH):
        grown = []
        for seq, p in frontier:
            dist = next_probs(prompt.tolist() + list(seq))
            for tok in dist.nonzero().view(-1).tolist():
                grown.append(((*seq, tok), p * float(dist[tok])))
        frontier = grown
    probs.update(frontier)
    return probs


def max_normalised_deviation(target, drafter, prompt, exact) -> tuple[float, int, int]:
    """Largest |empirical - exact| / standard error over the target's sequences; hits; accepted drafts."""
    g = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    hits = accepted = 0
    for _ in range(SAMPLES):
        result = generate_mirror(
            target, prompt, drafter, max_new_tokens=LENGTH, sampling=SAMPLING, generator=g
        )
        seq = tuple(result.tokens[:LENGTH])
        counts[seq] = counts.get(seq, 0) + 1
        hits += result.hits
        accepted += sum(result.accepted)
    worst = 0.0
    for seq, p in exact.items():
        stderr = math.sqrt(p * (1 - p) / SAMPLES)
        worst = max(worst, abs(counts.get(seq, 0) / SAMPLES - p) / stderr)
    if set(counts) - set(exact):  # a sequence the target alone can never produce
        worst = math.inf
    return worst, hits, accepted


@pytest.mark.slow
def test_sampled_mirror_decoding_keeps_the_target_distribution(sampling_setup):
    target, drafter, prompt, exact = sampling_setup
    worst, hits, accepted = max_normalised_deviation(target, drafter, prompt, exact)
    assert hits > SAMPLES // 10 and accepted > 50  # reused branches were verified, and drafts accepted
    assert worst < BOUND


def reuse_on_prefix_alone(grid, n_accepted, correction):
    """A broken rule: keeps the first branch at the rejection depth without checking its root is the
    target's correction (so the early exit's candidate is committed in the correction's place)."""
    hit = (grid.depths == n_accepted).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


@pytest.mark.slow
def test_a_broken_reuse_rule_fails_the_same_test(sampling_setup, monkeypatch):
    target, drafter, prompt, exact = sampling_setup
    monkeypatch.setattr(mirror_module, "reuse_branch", reuse_on_prefix_alone)
    worst, *_ = max_normalised_deviation(target, drafter, prompt, exact)
    assert worst > BOUND


def test_a_broken_reuse_rule_breaks_greedy_equality(monkeypatch):
    target = tiny_target("llama", layers=LAYERS)
    drafter = mirror_drafter(target, 2)
    monkeypatch.setattr(mirror_module, "reuse_branch", reuse_on_prefix_alone)
    outs = [
        (
            generate_mirror(target, p, drafter, max_new_tokens=24).tokens,
            generate(target, p, None, max_new_tokens=24).tokens,
        )
        for p in prompts()
    ]
    assert any(a != b for a, b in outs)


# ---- bad input ----------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_what_to_do():
    target = tiny_target("llama", layers=LAYERS)
    drafter = mirror_drafter(target, 2)
    prompt = prompts(1)[0]
    with pytest.raises(ValueError, match="trained on layer 2's outputs and cannot draft from layer 4's"):
        generate_mirror(target, prompt, drafter, MirrorSettings(4, 3, 3), max_new_tokens=4)
    for kappa, gamma in [(0, 3), (3, 0)]:
        with pytest.raises(ValueError, match="kappa >= 1 .* and gamma >= 1"):
            MirrorSettings(2, kappa, gamma)
    with pytest.raises(ValueError, match="not a mirror draft"):
        generate_mirror(target, prompt, EagleDrafter(drafter.head), max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the target's 6 decoder layers"):
        mirror_drafter(target, 6)
    with pytest.raises(ValueError, match="reads its early-exit layer alone"):
        build_objective(
            "mirror", target, {"early_exit_layer": 2, "capture_layer_ids": [1, 2], "draft_vocab_size": 259}
        )
    other = tiny_target("llama", layers=LAYERS + 2)
    from draftsmith.drafts.eagle import check_target

    with pytest.raises(ValueError, match="was trained for target"):
        check_target(drafter.head.config, other)
    from draftsmith.drafts.engines import VLLM

    with pytest.raises(ValueError, match="no serving engine runs mirror decoding"):
        draft_kind("mirror").refuse_export(VLLM)


def test_a_saved_mirror_draft_reloads_as_one(tmp_path):
    target = tiny_target("llama", layers=LAYERS)
    drafter = mirror_drafter(target, 2, kappa=5, gamma=2)
    drafter.head.save_pretrained(tmp_path / "draft")
    from draftsmith.drafts import build_drafter

    again = build_drafter(str(tmp_path / "draft"), target)
    assert isinstance(again, MirrorDrafter) and again.mirror == MirrorSettings(2, 5, 2)
    prompt = prompts(1)[0]
    assert (
        generate_mirror(target, prompt, again, max_new_tokens=12).tokens
        == generate(target, prompt, None, max_new_tokens=12).tokens
    )


def test_the_exact_distribution_enumerates_every_sequence(sampling_setup):
    *_, exact = sampling_setup
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)
    assert len(exact) == TOP_K**LENGTH and all(len(s) == LENGTH for s in itertools.islice(exact, 3))
    assert max(exact.values()) < 0.5  # outcomes the test can tell apart


# ---- the kind end to end: trained by the loop, evaluated by `draftsmith eval` --------------------------


def test_a_mirror_draft_trains_in_the_loop_and_eval_reports_it(tmp_path, capsys):
    import json

    from test_loop import make_config
    from tiny import tiny_model, tiny_tokenizer

    from draftsmith.cli import main
    from draftsmith.train.loop import train

    target_dir = tmp_path / "target"
    tiny_model("llama", layers=LAYERS).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    data = tmp_path / "train.jsonl"

    def turns(i: int) -> list[dict]:
        return [{"from": "human", "value": f"count from {i}"}, {"from": "gpt", "value": f"{i} {i + 1}"}]

    data.write_text("".join(json.dumps({"conversations": turns(i)}) + "\n" for i in range(16)))
    options = "--draft.options={early_exit_layer: 3, kappa: 2, gamma: 3, draft_vocab_size: 64, ttt_steps: 2}"
    config = make_config(
        target_dir, data, tmp_path / "run", "--draft.kind=mirror", options, "--trainer.max_steps=2",
        "--trainer.val_k=2", "--optim.lr=1e-3",
    )  # fmt: skip
    result = train(config, enable_progress_bar=False)
    saved = json.loads((result.draft_dir / "config.json").read_text())
    assert saved["draftsmith_kind"] == "mirror" and saved["mirror"] == {
        "early_exit_layer": 3,
        "kappa": 2,
        "gamma": 3,
    }
    assert saved["capture_layer_ids"] == [3]

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"count from {i}", "category": "c"}) + "\n" for i in range(2))
    )
    out = tmp_path / "eval"
    argv = ["eval", "--target", str(target_dir), "--draft", str(tmp_path / "run"), "--draft", "ngram",
            "--prompts", str(prompts), "--max-new-tokens", "16", "--mirror-kappa", "3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    mirror, ngram = report["drafts"]
    assert mirror["exact_match"] is True and "mirror" not in ngram
    m = mirror["mirror"]
    assert m["reuse_chances"] > 0 and 0 <= m["branch_reuse_hit_rate"] <= 1
    assert set(m["ms_per_step"]) == {
        "fresh_draft",
        "target_prefix",
        "early_exit",
        "target_suffix",
        "rollouts",
        "verify",
    }
    assert m["modelled_speedup"] > 0 and m["channel_latency_ms"] == 0.1
    # the modelled figure has its own table, never the measured speedup's column
    assert "modelled_speedup is a MODEL" in table and "modelled_speedup" in (out / "report.md").read_text()
    assert (
        main([*argv[:3], "--draft", "ngram", *argv[7:], "--overwrite"]) == 2
    )  # --mirror-kappa, no mirror draft
    assert "no --draft is a mirror draft" in capsys.readouterr().err


def test_the_two_device_model_by_hand():
    from draftsmith.decode.mirror import MirrorResult
    from draftsmith.eval.cli import add_parser
    from draftsmith.eval.harness import run_stats
    from draftsmith.eval.mirror_stats import DEFAULT_CHANNEL_LATENCY_MS

    result = MirrorResult(tokens=[1, 2, 3], prefill_seconds=1.0)
    result.parts = [
        (0.5, 2.0, 0.2, 1.0, 3.0, 0.1),
        (0.0, 2.0, 0.2, 1.0, 0.25, 0.1),
    ]  # rollouts longer, shorter
    assert math.isclose(
        result.overlapped_seconds(), 1.0 + (0.5 + 2 + 0.2 + 3 + 0.1) + (0 + 2 + 0.2 + 1 + 0.1)
    )
    assert math.isclose(result.two_device_seconds(0.01), result.overlapped_seconds() + 0.02)
    result.hits, result.reuse_chances = 1, 1
    stats = run_stats(result) + run_stats(result)  # the mode's own statistics sum with the rest
    assert stats.timing.generations == 2 and stats.mode.key == "mirror"
    assert stats.mode.steps == 4 and stats.mode.hit_rate == 1.0
    assert math.isclose(stats.mode.part_seconds[4], 2 * 3.25)
    assert math.isclose(stats.mode.two_device_seconds(0.01), 2 * result.two_device_seconds(0.01))
    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.get_default("channel_latency_ms") == DEFAULT_CHANNEL_LATENCY_MS


def test_mirror_decoding_is_a_capability_the_drafter_offers():
    """The Drafter base knows no mirror member: a drafter offers mirror decoding by being a GridDrafter."""
    from draftsmith.decode.drafter import Drafter
    from draftsmith.decode.mirror import GridDrafter
    from draftsmith.drafts.ngram import NgramDrafter

    assert not hasattr(Drafter, "mirror") and not hasattr(Drafter, "rollout")
    target = tiny_target("llama", layers=LAYERS)
    drafter = mirror_drafter(target, 2)
    assert isinstance(drafter, GridDrafter)
    assert not isinstance(EagleDrafter(drafter.head), GridDrafter) and not isinstance(
        NgramDrafter(), GridDrafter
    )
