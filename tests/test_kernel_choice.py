"""The CPU kernels chosen by measurement (decode/kernel_choice.py) and transformers' generate as the
user's baseline in eval reports (eval/harness.py, eval/report.py)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model, tiny_target

from draftsmith.decode import kernel_choice
from draftsmith.decode.cpu_kernels import (
    KernelPolicy,
    PackedLinear,
    pack_for_decoding,
    packing_unavailable,
    stock_kernels,
)
from draftsmith.decode.speculative import generate
from draftsmith.drafts.ngram import NgramDrafter
from draftsmith.eval.harness import GENERATE, evaluate
from draftsmith.eval.prompts import EvalPrompt
from draftsmith.eval.report import build_report, format_table

pytestmark = pytest.mark.skipif(
    packing_unavailable("cpu", torch.float32) is not None, reason="no oneDNN linear in this PyTorch"
)


def _count_kernels(monkeypatch) -> dict[str, int]:
    """Calls of the packed (oneDNN) and the stock product from now on."""
    calls = {"packed": 0, "stock": 0}
    packed_op, stock_op = torch.ops.mkldnn._linear_pointwise, torch.nn.functional.linear

    def packed(*args, **kwargs):
        calls["packed"] += 1
        return packed_op(*args, **kwargs)

    def stock(*args, **kwargs):
        calls["stock"] += 1
        return stock_op(*args, **kwargs)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", packed)
    monkeypatch.setattr(torch.nn.functional, "linear", stock)
    return calls


def test_the_policy_picks_the_kernel_by_rows_and_stock_kernels_overrides_it(monkeypatch):
    linear = torch.nn.Linear(16, 8).requires_grad_(False)
    layer = PackedLinear(linear, KernelPolicy(plain="stock", verify="packed"))
    calls = _count_kernels(monkeypatch)
    one, six = torch.randn(1, 16), torch.randn(6, 16)
    torch.testing.assert_close(layer(one), linear(one))
    assert calls == {"packed": 0, "stock": 2}  # the layer's stock product, and the reference's
    torch.testing.assert_close(layer(six), linear(six))
    assert calls == {"packed": 1, "stock": 3}
    model = torch.nn.Sequential(layer)
    with stock_kernels(model):
        model(six)
    assert calls == {"packed": 1, "stock": 4}
    assert (layer.policy.plain, layer.policy.verify) == ("stock", "packed")  # put back after the block
    model(six)
    assert calls["packed"] == 2
    with pytest.raises(ValueError, match="KernelPolicy.plain = 'fast'"):
        KernelPolicy(plain="fast")


def _fake_timings(plain: dict, verify: dict):
    def measure(target, policy, width, rounds=kernel_choice.ROUNDS):
        return {"plain": plain, "verify": verify}

    return measure


def test_each_shape_keeps_its_faster_kernel_and_the_choice_is_cached(monkeypatch, tmp_path):
    target = tiny_target()
    policy = KernelPolicy()
    pack_for_decoding(target.model, policy=policy)
    cache = tmp_path / "kernels.json"
    monkeypatch.setattr(
        kernel_choice, "measure", _fake_timings({"packed": 3.0, "stock": 2.0}, {"packed": 4.0, "stock": 5.0})
    )
    choice = kernel_choice.choose_kernels(target, policy, 6, cache=cache)
    assert (choice["plain"], choice["verify"], choice["source"]) == ("stock", "packed", "measured")
    assert (policy.plain, policy.verify) == ("stock", "packed")
    assert choice["ms"]["verify"] == {"packed": 4.0, "stock": 5.0} and choice["width"] == 6
    assert "plain (1 token) stock: packed 3.0 ms, stock 2.0 ms" in kernel_choice.describe(choice)

    def never(*args, **kwargs):
        raise AssertionError("a cached choice is not measured again")

    monkeypatch.setattr(kernel_choice, "measure", never)
    fresh = KernelPolicy()
    again = kernel_choice.choose_kernels(target, fresh, 6, cache=cache)
    assert (again["source"], fresh.plain, fresh.verify) == ("cached", "stock", "packed")
    # another verify width is another entry: measured
    monkeypatch.setattr(
        kernel_choice, "measure", _fake_timings({"packed": 1.0, "stock": 2.0}, {"packed": 9.0, "stock": 5.0})
    )
    wider = kernel_choice.choose_kernels(target, KernelPolicy(), 9, cache=cache)
    assert (wider["source"], wider["plain"], wider["verify"]) == ("measured", "packed", "stock")
    assert len(json.loads(cache.read_text())) == 2
    # remeasure, and a damaged cache file, both measure again
    assert (
        kernel_choice.choose_kernels(target, KernelPolicy(), 6, remeasure=True, cache=cache)["source"]
        == "measured"
    )
    cache.write_text("{not json")
    assert kernel_choice.choose_kernels(target, KernelPolicy(), 6, cache=cache)["source"] == "measured"
    with pytest.raises(ValueError, match="at least 1 token"):
        kernel_choice.choose_kernels(target, KernelPolicy(), 0, cache=cache)


def test_a_real_measurement_leaves_the_target_as_it_was_and_decoding_exact(tmp_path):
    target = tiny_target()
    prompt = torch.tensor([5, 6, 7, 5, 6, 7, 5, 6])
    expected = generate(target, prompt, None, k=0, max_new_tokens=16).tokens
    policy = KernelPolicy()
    pack_for_decoding(target.model, policy=policy)
    choice = kernel_choice.choose_kernels(target, policy, 4, cache=tmp_path / "k.json")
    for shape in ("plain", "verify"):
        assert choice[shape] in ("packed", "stock")
        assert all(ms > 0 for ms in choice["ms"][shape].values())
    assert target.length == 0  # the timed steps leave no cached positions behind
    assert generate(target, prompt, None, k=0, max_new_tokens=16).tokens == expected
    spec = generate(target, prompt, NgramDrafter(), k=3, max_new_tokens=16).tokens
    assert spec == expected


def test_eval_runs_transformers_generate_beside_the_target_alone():
    target = tiny_target()
    prompts = [EvalPrompt("a", "chat", ["abc abc abc"]), EvalPrompt("b", "code", ["x = 1; x = 1; x ="])]
    result = evaluate(target, [("ngram", NgramDrafter())], prompts, k=3, max_new_tokens=10,
                      transformers_baseline=True)  # fmt: skip
    assert result.generate is not None and result.generate.name == GENERATE
    # greedy: transformers' own generate writes the target's tokens, as the shared decoder does
    assert result.generate.outputs == result.baseline.outputs and result.generate.exact_match is True
    report = build_report(result, target.name, {"k": 3}, "cpu")
    gen, (draft,) = report["generate"], report["drafts"]
    assert gen["new_tokens"] == report["baseline"]["new_tokens"] and gen["tokens_per_s"] > 0
    assert draft["speedup_vs_generate"] == pytest.approx(draft["tokens_per_s"] / gen["tokens_per_s"])
    assert report["baseline"]["speedup_vs_generate"] == pytest.approx(
        report["baseline"]["tokens_per_s"] / gen["tokens_per_s"]
    )
    for cat in ("chat", "code"):
        per = draft["categories"][cat]["speedup_vs_generate"]
        assert per == pytest.approx(
            draft["categories"][cat]["tokens_per_s"] / gen["categories"][cat]["tokens_per_s"]
        )
    table = format_table(report)
    assert "vs-gen" in table.splitlines()[0] and GENERATE in table
    without = evaluate(target, [("ngram", NgramDrafter())], prompts, k=3, max_new_tokens=10)
    report = build_report(without, target.name, {"k": 3}, "cpu")
    assert "generate" not in report and "speedup_vs_generate" not in report["drafts"][0]


def test_the_generate_baseline_runs_on_stock_kernels(monkeypatch):
    target = tiny_target()
    pack_for_decoding(target.model, policy=KernelPolicy())
    calls = _count_kernels(monkeypatch)
    prompts = [EvalPrompt("a", "chat", ["abc abc abc"])]
    evaluate(target, [], prompts, k=3, max_new_tokens=6, warmup=0)
    packed_by_ours = calls["packed"]
    assert packed_by_ours > 0
    calls.update(packed=0, stock=0)
    result = evaluate(target, [], prompts, k=3, max_new_tokens=6, warmup=0, transformers_baseline=True)
    assert calls["packed"] == packed_by_ours  # the target alone's; generate added stock products only
    assert calls["stock"] > 0 and result.generate.exact_match is True


def test_eval_cli_reports_the_kernel_choice_and_refuses_packed_where_it_cannot_run(tmp_path, capsys):
    from tiny import save_tiny_model

    from draftsmith.cli import main

    model = tmp_path / "model"
    save_tiny_model(model)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc", "category": "code"}) + "\n")
    argv = ["eval", "--target", str(model), "--draft", "ngram", "--prompts", str(prompts),
            "--max-new-tokens", "8", "--k", "3"]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "auto")]) == 0
    printed = capsys.readouterr().out
    assert "kernels (measured): plain (1 token)" in printed and "vs-gen" in printed
    report = json.loads((tmp_path / "auto" / "report.json").read_text())
    kernels = report["kernels"]
    assert kernels["mode"] == "auto" and kernels["width"] == 4 and set(kernels["ms"]) == {"plain", "verify"}
    assert report["generate"]["exact_match"] is True and "speedup_vs_generate" in report["drafts"][0]
    assert main([*argv, "--out", str(tmp_path / "again")]) == 0
    assert "kernels (cached)" in capsys.readouterr().out
    assert (
        main([*argv, "--cpu-kernels", "stock", "--no-generate-baseline", "--out", str(tmp_path / "s")]) == 0
    )
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    assert (
        report["kernels"] == {"mode": "stock", "plain": "stock", "verify": "stock"}
        and "generate" not in report
    )
    code = main([*argv, "--dtype", "bfloat16", "--cpu-kernels", "packed", "--out", str(tmp_path / "b")])
    assert code == 2
    assert (
        "--cpu-kernels packed: dtype is torch.bfloat16, packing is used for float32 only"
        in capsys.readouterr().err
    )


def test_packed_and_stock_give_the_same_greedy_tokens_on_a_tiny_model():
    model = tiny_model("qwen2").requires_grad_(False)
    from tiny import tiny_tokenizer

    from draftsmith.decode.target import Target

    target = Target(model, tiny_tokenizer(), "tiny-qwen2")
    policy = KernelPolicy()
    pack_for_decoding(target.model, policy=policy)
    prompt = torch.tensor([9, 8, 7, 9, 8, 7, 9])
    outputs = {}
    for kernel in ("packed", "stock"):
        with policy.forced(kernel):
            outputs[kernel] = generate(target, prompt, NgramDrafter(), k=3, max_new_tokens=20).tokens
    assert outputs["packed"] == outputs["stock"]
