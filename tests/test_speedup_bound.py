"""The speedup bound beside every measured speedup: by hand, through the decoder on a fake clock, and in
`draftsmith eval`'s report on tiny real models."""

from __future__ import annotations

import json
import math
import types
from collections import Counter

import pytest
import torch
from tiny import save_tiny_model, tiny_target

import draftsmith.decode.speculative as speculative
from draftsmith.cli import main
from draftsmith.decode.cost_model import expected_tokens
from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.speculative import generate
from draftsmith.decode.tree import TreeSpec
from draftsmith.drafts.ngram import NgramDrafter
from draftsmith.eval.harness import EvalResult, Method, MethodResult, evaluate
from draftsmith.eval.prompts import EvalPrompt, render
from draftsmith.eval.report import build_report, format_markdown, format_table
from draftsmith.eval.stats import AcceptanceStats, RunStats, SpeedupBound, Timing

# Per-position acceptance that differs by position: of 100 steps of k = 3, 80 accept token 1, 40 of those
# accept token 2, 10 of those accept token 3. E = 1 + .8 + .8*.5 + .8*.5*.25 = 2.3.
RATES = [0.8, 0.5, 0.25]
STEPS_K3 = {(3, 0): 20, (3, 1): 40, (3, 2): 30, (3, 3): 10}
E_K3 = 1 + 0.8 + 0.4 + 0.1


def alpha_formula(stats: AcceptanceStats, k: int) -> float:
    """The broken formula the bound must not be: one rate α for every position (1 + α + ... + α^k)."""
    return sum(stats.alpha**i for i in range(k + 1))


def test_expected_tokens_is_the_per_position_product_formula():
    assert expected_tokens(RATES, 0) == 1.0
    assert expected_tokens(RATES, 1) == pytest.approx(1.8)
    assert expected_tokens(RATES, 3) == pytest.approx(E_K3)
    with pytest.raises(ValueError, match="one rate per position"):
        expected_tokens(RATES, 4)


def test_bound_by_hand_with_rates_that_differ_by_position():
    acc = AcceptanceStats(Counter(STEPS_K3))
    assert acc.per_position == pytest.approx(RATES)
    assert acc.expected_tokens == pytest.approx(E_K3)
    assert abs(alpha_formula(acc, 3) - E_K3) > 0.5  # α = 13/30 gives 1.70: the test tells them apart
    # 100 steps: 3 ms drafting and 13 ms verifying each; the target alone: 50 decode steps of 10 ms
    draft = RunStats(acc, Timing(draft_seconds=0.3, verify_seconds=1.3))
    baseline = RunStats(AcceptanceStats(Counter({(0, 0): 50})), Timing(seconds=0.6, prefill_seconds=0.1))
    bound = SpeedupBound.measure(draft, baseline)
    assert bound.draft_cost == pytest.approx(0.3) and bound.verify_cost == pytest.approx(1.3)
    assert bound.plain_step_seconds == pytest.approx(0.010)
    assert bound.speedup == pytest.approx(2.3 / 1.6)
    assert bound.chain_lengths == {3: 100} and bound.mean_chain_length == 3.0
    assert bound.draft_cost_per_token == pytest.approx(0.1)  # Leviathan's c: 1 ms per token / 10 ms
    assert bound.efficiency(1.2) == pytest.approx(1.2 / (2.3 / 1.6))


def test_bound_with_k_varying_per_step_weights_each_chain_length():
    """--k auto: plain steps (k = 0), k = 2 and k = 4 steps, each with E(k) from the pooled per-position rates."""
    steps = {(0, 0): 10, (2, 0): 5, (2, 1): 5, (2, 2): 10, (4, 1): 10, (4, 4): 10}
    acc = AcceptanceStats(Counter(steps))
    # judged / accepted at each position: 40/35, 35/20, 10/10, 10/10
    assert acc.per_position == pytest.approx([35 / 40, 20 / 35, 1.0, 1.0])
    e2 = 1 + 35 / 40 + 20 / 40
    e4 = e2 + 20 / 40 + 20 / 40
    assert acc.chain_lengths == {0: 10, 2: 20, 4: 20}
    assert acc.expected_tokens == pytest.approx((10 * 1 + 20 * e2 + 20 * e4) / 50)
    assert acc.expected_tokens != pytest.approx(expected_tokens(acc.per_position, 4))  # not E(k_max) for all


def test_expected_tokens_come_from_the_rates_not_from_tau():
    """Equal to τ when every step drafts the same k (the product telescopes); apart when acceptance depends
    on the chain length: here short chains are always accepted and long ones mostly not."""
    assert AcceptanceStats(Counter(STEPS_K3)).expected_tokens == pytest.approx(
        AcceptanceStats(Counter(STEPS_K3)).tau
    )
    acc = AcceptanceStats(Counter({(1, 1): 10, (3, 3): 10, (3, 0): 20}))
    assert acc.per_position == pytest.approx([0.5, 1.0, 1.0])
    assert acc.tau == pytest.approx(2.0)
    assert acc.expected_tokens == pytest.approx((10 * 1.5 + 30 * 2.5) / 40)  # 2.25


def test_a_position_no_chain_judged_adds_nothing():
    acc = AcceptanceStats(Counter({(3, 0): 1, (1, 1): 1}))  # token 2 was proposed once, never judged
    assert math.isnan(acc.per_position[1])
    assert acc.expected_tokens == pytest.approx(1.5)


def test_no_decode_step_gives_no_bound():
    empty = RunStats()
    some = RunStats(AcceptanceStats(Counter({(0, 0): 3})), Timing(seconds=0.03, verify_seconds=0.03))
    assert SpeedupBound.measure(empty, some) is None and SpeedupBound.measure(some, empty) is None


# -- a synthetic drafter through the real decoder, on a fake clock -----------------------------------

K = 3
PATTERN = [0, 0, 1, 1, 1, 1, 2, 2, 2, 3]
"""Draft tokens right per step, in turn: per-position acceptance 8/10, 4/8, 1/4 (the RATES above)."""
CYCLES = 2
MAX_NEW = 1 + CYCLES * sum(a + 1 for a in PATTERN)  # the prefill's token + 23 per cycle: no step is cut
PREFILL_S, DRAFT_S_PER_TOKEN = 0.04, 0.001


def verify_s(n: int) -> float:
    """Fake seconds of a target pass over n tokens: 10 ms for one (a plain step), 1 ms per extra token."""
    return 0.010 + 0.001 * (n - 1)


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class ScriptedDrafter(Drafter):
    """Knows the target's greedy continuation and gets exactly PATTERN[step] tokens of it right per step."""

    name = "scripted"

    def __init__(self, continuation: list[int], vocab_size: int, clock: Clock):
        self.continuation, self.vocab_size, self.clock = continuation, vocab_size, clock
        self.steps = 0

    def begin(self, prompt, features):
        self.prompt_len = len(prompt)

    def propose(self, tokens, k, sampling, generator):
        done = len(tokens) - self.prompt_len
        right = PATTERN[self.steps % len(PATTERN)]
        self.steps += 1
        truth = self.continuation[done : done + k]
        drafted = [t if i < right else (t + 1) % self.vocab_size for i, t in enumerate(truth)]
        self.clock.now += DRAFT_S_PER_TOKEN * k
        return Proposal(torch.tensor(drafted, dtype=torch.long))

    def commit(self, num_accepted, features):
        pass


def fake_clock_run(monkeypatch, prefill_s: float = PREFILL_S, between_steps_s: float = 0.0, k=K) -> dict:
    """Evaluate the scripted drafter at ``k`` against the target alone, every second on a fake clock:
    prefill, target passes (``verify_s``), drafting, and ``between_steps_s`` per committed step."""
    target = tiny_target("llama")
    target.eos_ids = set()
    prompt = EvalPrompt("p0", "chat", ("Tell me about cats.",))
    ids = render(target.tokenizer, [{"role": "user", "content": prompt.turns[0]}])
    continuation = generate(target, ids, None, max_new_tokens=MAX_NEW + K).tokens

    clock = Clock()
    monkeypatch.setattr(speculative, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    forward = target.forward

    def timed_forward(tokens, *args, **kwargs):
        n = tokens.shape[-1]
        clock.now += prefill_s if n > K + 1 else verify_s(n)
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(target, "forward", timed_forward)
    commit = speculative.commit_tokens

    def slow_commit(*args):  # the decoder's own work between steps, outside drafting and verifying
        clock.now += between_steps_s
        return commit(*args)

    monkeypatch.setattr(speculative, "commit_tokens", slow_commit)
    drafter = ScriptedDrafter(continuation, target.model.config.vocab_size, clock)
    result = evaluate(
        target, [("scripted", drafter)], [prompt], k=k, max_new_tokens=MAX_NEW, warmup=0, k_max=K
    )
    assert result.drafts[0].exact_match is True
    return build_report(result, "tiny", {"k": K}, "fake clock")


def test_bound_of_a_synthetic_drafter_on_a_fake_clock(monkeypatch):
    report = fake_clock_run(monkeypatch)
    d = report["drafts"][0]
    assert d["acceptance"]["steps"] == [[K, a, CYCLES * PATTERN.count(a)] for a in range(K + 1)]
    assert d["per_position"] == pytest.approx(RATES)
    b = d["bound"]
    assert b["chain_lengths"] == {str(K): CYCLES * len(PATTERN)} and b["mean_chain_length"] == K
    assert b["expected_tokens"] == pytest.approx(E_K3)
    assert b["plain_step_ms"] == pytest.approx(10.0)
    assert b["draft_cost"] == pytest.approx(0.3) and b["verify_cost"] == pytest.approx(1.3)
    assert d["speedup_bound"] == pytest.approx(E_K3 / (0.3 + 1.3))  # 1.4375

    # measured: the same MAX_NEW tokens, each run with one 40 ms prefill; the target alone then takes
    # MAX_NEW - 1 plain steps of 10 ms, the draft 20 steps of 3 + 13 ms
    base_s = PREFILL_S + (MAX_NEW - 1) * 0.010
    draft_s = PREFILL_S + CYCLES * len(PATTERN) * (0.003 + 0.013)
    assert report["baseline"]["seconds"] == pytest.approx(base_s)
    assert d["seconds"] == pytest.approx(draft_s)
    measured = base_s / draft_s
    assert d["speedup"] == pytest.approx(measured)
    assert d["efficiency"] == pytest.approx(measured / (E_K3 / 1.6))
    assert d["efficiency"] == pytest.approx(d["speedup"] / d["speedup_bound"])
    assert d["categories"]["chat"]["speedup_bound"] == pytest.approx(d["speedup_bound"])
    assert d["categories"]["chat"]["efficiency"] == pytest.approx(d["efficiency"])


def test_without_prefill_the_decoder_delivers_the_whole_bound(monkeypatch):
    """Nothing outside the draft and verify steps costs time: measured speedup = bound, efficiency 1."""
    d = fake_clock_run(monkeypatch, prefill_s=0.0)["drafts"][0]
    assert d["speedup"] == pytest.approx(E_K3 / 1.6) and d["efficiency"] == pytest.approx(1.0)


def test_time_between_steps_lowers_the_efficiency_not_the_bound(monkeypatch):
    """1 ms of bookkeeping per step in both loops: the target alone's steps cost 11 ms, so the draft's
    costs are 3/11 and 13/11; the bound is what a draft loop with no such time would reach."""
    d = fake_clock_run(monkeypatch, prefill_s=0.0, between_steps_s=0.001)["drafts"][0]
    assert d["bound"]["plain_step_ms"] == pytest.approx(11.0)
    bound = E_K3 / ((0.003 + 0.013) / 0.011)
    assert d["speedup_bound"] == pytest.approx(bound)
    measured = (MAX_NEW - 1) * 0.011 / (CYCLES * len(PATTERN) * 0.017)
    assert d["speedup"] == pytest.approx(measured) and measured < bound
    assert d["efficiency"] == pytest.approx(measured / bound)  # 0.94: the decoder's share


def test_with_k_auto_the_bound_takes_the_ks_as_run(monkeypatch):
    """The cost model varies k per step (0 included); with no time outside the steps the measured speedup
    is τ · plain / mean step cost, and the bound E · plain / mean step cost, so efficiency = τ / E exactly."""
    d = fake_clock_run(monkeypatch, prefill_s=0.0, k="auto")["drafts"][0]
    chosen = {int(n): c for n, c in d["bound"]["chain_lengths"].items()}
    assert len(chosen) > 1 and 0 in chosen  # several chain lengths, plain steps among them
    draft_s = sum(DRAFT_S_PER_TOKEN * n * c for n, c in chosen.items())
    verify_total = sum(verify_s(n + 1) * c for n, c in chosen.items())
    steps = sum(chosen.values())
    assert d["bound"]["draft_cost"] == pytest.approx(draft_s / steps / 0.010)
    assert d["bound"]["verify_cost"] == pytest.approx(verify_total / steps / 0.010)
    assert d["efficiency"] == pytest.approx(d["tau"] / d["bound"]["expected_tokens"])


def test_the_bound_appears_in_the_table_and_markdown(monkeypatch):
    report = fake_clock_run(monkeypatch)
    table = format_table(report)
    header = table.splitlines()[0].split()
    assert header[5:9] == ["speedup", "vs-gen", "bound", "eff"]
    draft_row = next(line for line in table.splitlines() if line.startswith("scripted"))
    assert "1.44" in draft_row and f"{report['drafts'][0]['efficiency']:.2f}" in draft_row
    md = format_markdown(report)
    assert "| draft | category | τ | α | tok/s | speedup | vs-gen | bound | eff | exact |" in md
    assert "Speedup bound, chain drafting" in md and "| scripted | 3: 20 | 2.30 | 2.30 | 0.30 | 1.30 |" in md


# -- trees and mirror decoding: no bound, said so ---------------------------------------------------


def test_tree_decoding_reports_no_bound_and_says_why():
    target = tiny_target("llama")
    prompt = EvalPrompt("p0", "code", ("abc abc abc abc abc",))
    result = evaluate(
        target, [("ngram", NgramDrafter())], [prompt], max_new_tokens=12, warmup=0, tree=TreeSpec(2, 2, 4)
    )
    report = build_report(result, "tiny", {}, "")
    d = report["drafts"][0]
    assert d["speedup"] is not None
    assert d["speedup_bound"] is None and d["efficiency"] is None
    assert "chain drafting" in d["bound"]["note"]
    assert d["categories"]["code"]["speedup_bound"] is None
    assert "no bound: it is for chain drafting" in format_markdown(report)


def test_mirror_decoding_reports_no_bound():
    class MirrorLike(NgramDrafter):  # offers mirror decoding: a GridDrafter
        mirror = object()

        def rollout(self, *args):
            raise AssertionError("not run here")

    assert Method("m", MirrorLike()).decoding == "mirror"
    assert Method("t", NgramDrafter(), tree=TreeSpec(2, 2, 4)).decoding == "tree"
    assert Method("c", NgramDrafter(), k=3).decoding == "chain"
    timing = Timing(generations=1, new_tokens=13, seconds=1.0, draft_seconds=0.2, verify_seconds=0.5)
    stats = RunStats(AcceptanceStats(Counter({(3, 2): 4})), timing)
    base = RunStats(AcceptanceStats(Counter({(0, 0): 12})), Timing(1, 13, seconds=0.6))
    draft = MethodResult("m", stats, {"chat": stats}, decoding="mirror")
    result = EvalResult(MethodResult("target alone", base, {"chat": base}), [draft], ["chat"], True)
    d = build_report(result, "tiny", {}, "")["drafts"][0]
    assert d["speedup_bound"] is None and "mirror" in d["bound"]["note"]
    draft.decoding = "chain"  # the same numbers as a chain: a bound
    d = build_report(result, "tiny", {}, "")["drafts"][0]
    # 4 steps of 50 + 125 ms against plain steps of 50 ms: costs 1.0 + 2.5; E = 3 (two of three accepted)
    assert d["speedup_bound"] == pytest.approx(3.0 / 3.5)


# -- `draftsmith eval` on tiny real models ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("k", ["3", "auto"])
def test_eval_report_has_the_bound_on_real_tiny_models(model_dir, tmp_path, capsys, k):
    prompts = tmp_path / "prompts.jsonl"
    records = [{"prompt": "abc abc abc abc", "category": "code"}, {"prompt": "Tell me about cats."}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    argv = ["eval", "--target", str(model_dir), "--draft", str(model_dir), "--draft", "ngram"]
    argv += ["--prompts", str(prompts), "--max-new-tokens", "12", "--k", k, "--k-max", "3", "--out", str(out)]
    assert main(argv) == 0
    assert "bound" in capsys.readouterr().out.splitlines()[0]
    report = json.loads((out / "report.json").read_text())
    for d in report["drafts"]:
        assert math.isfinite(d["speedup_bound"]) and d["speedup_bound"] > 0
        assert math.isfinite(d["efficiency"])
        assert d["efficiency"] == pytest.approx(d["speedup"] / d["speedup_bound"])
        b = d["bound"]
        steps = sum(n for _, _, n in d["acceptance"]["steps"])
        assert sum(b["chain_lengths"].values()) == steps
        assert b["plain_step_ms"] > 0 and b["draft_cost"] >= 0 and b["verify_cost"] > 0
        for cat in d["categories"].values():
            assert {"speedup_bound", "efficiency"} <= set(cat)
    same = report["drafts"][0]  # the target as its own draft accepts everything: E = τ
    assert same["bound"]["expected_tokens"] == pytest.approx(same["tau"])
    assert "Speedup bound, chain drafting" in (out / "report.md").read_text()
