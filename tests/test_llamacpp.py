"""llama.cpp, run for real, judges the GGUF exports: tokenizer, a draft model's logits, an EAGLE-3 head's drafts.

Needs the optional build (``bash scripts/install_llamacpp.sh``); skipped without it. Everything runs on
a tiny random-init Llama target written as an f32 GGUF by draftsmith's own writer, so llama.cpp and
draftsmith compute the same model.
"""

from __future__ import annotations

import re

import pytest
import torch
from benchlib.llamacpp_runs import SpeculativeRun
from tiny import tiny_bpe_target_gguf
from transformers import AutoModelForCausalLM

from draftsmith import llamacpp
from draftsmith.decode.speculative import generate
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import distill
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.eagle_parts import build_vocab_map
from draftsmith.export import export_checkpoint
from draftsmith.export import gguf as gguf_export
from draftsmith.export.verify import verify_export

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not llamacpp.available(), reason=f"llama.cpp is not built (optional extra: {llamacpp.INSTALL})"
    ),
]

TEXTS = [
    "  #",  # GPT-2's regex keeps "  " apart from "#"; llama.cpp's default pre-tokenizer does not
    "The quick <|im_start|>brown dog<|im_end|> def add(a, b): return a + b",
    "x = 12345;  y=-3.5e7\n\n\tprint(add(2, 3))!!",
]
K = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target as a transformers Target and as an f32 GGUF; a small draft of it as a GGUF."""
    root = tmp_path_factory.mktemp("llamacpp")
    target, target_gguf = tiny_bpe_target_gguf(root)
    draft = distill.from_config(target, 2, 32, seed=1).eval()
    draft_dir = distill.save_draft(draft, target.tokenizer, target, root / "small" / "draft")
    draft_gguf = export_checkpoint(locate_checkpoint(str(draft_dir)), "gguf", root / "small.gguf", "f32")
    return {
        "root": root,
        "target": target,
        "target_gguf": target_gguf,
        "draft_dir": draft_dir,
        "draft_gguf": draft_gguf,
    }


def test_llamacpp_tokenizes_and_detokenizes_as_transformers_does(tiny):
    tokenizer = tiny["target"].tokenizer
    with llamacpp.Server(tiny["draft_gguf"], ["-c", "256"]) as server:
        for text in TEXTS:
            assert server.tokenize(text) == tokenizer(text, add_special_tokens=False).input_ids, text
        chat = tokenizer("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).input_ids
        assert server.detokenize(chat) == tokenizer.decode(chat)
        # generated text leaves control tokens out, as transformers' skip_special_tokens does: an added
        # special token typed USER_DEFINED instead of CONTROL would be printed
        start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        out = server.complete(chat[:3], 1, logit_bias=[[start, 1000.0]])
        assert out["tokens"] == [start] and out["content"] == tokenizer.decode(
            [start], skip_special_tokens=True
        )


def test_llamacpp_scores_the_small_draft_as_transformers_does(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny["draft_dir"], dtype=torch.float32).eval()
    prompt = tiny["target"].tokenizer(TEXTS[1], add_special_tokens=False).input_ids
    n = 16
    with llamacpp.Server(tiny["draft_gguf"], ["-c", "256"]) as server:
        out = server.complete(prompt, n, n_probs=5, post_sampling_probs=False)
    tokens = out["tokens"]
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    assert tokens == logprobs.argmax(-1).tolist()  # llama.cpp's greedy continuation is transformers'
    # the server reports a token's probabilities once its text is whole UTF-8 (byte pieces are skipped)
    position, compared = 0, 0
    for entry in out["completion_probabilities"]:
        position = tokens.index(entry["id"], position)
        expected = logprobs[position].topk(5)
        top = entry["top_logprobs"]
        assert [t["id"] for t in top] == expected.indices.tolist()
        theirs = torch.tensor([t["logprob"] for t in top])
        torch.testing.assert_close(theirs, expected.values, rtol=0, atol=1e-4)
        position, compared = position + 1, compared + 1
    assert compared >= n // 2


def test_speculative_run_counts_what_llamacpp_accepted(tiny):
    """The target drafting for itself (its own GGUF as the draft model): every proposal is accepted, the
    outputs are the target alone's, and the steps account for every token made."""
    prompt = tiny["target"].tokenizer(TEXTS[1], add_special_tokens=False).input_ids
    root, n = tiny["root"], 24
    with (
        llamacpp.Server(tiny["target_gguf"], llamacpp.speculative_args(None, K), log=root / "alone.log") as a,
        llamacpp.Server(
            tiny["target_gguf"],
            llamacpp.speculative_args("draft", K, tiny["target_gguf"]),
            log=root / "self.log",
        ) as s,
    ):
        alone = SpeculativeRun("alone", a, root / "alone.log")
        itself = SpeculativeRun("self", s, root / "self.log")
        for run in (alone, itself):
            run.complete(prompt, n)
    row = itself.summary(alone)
    assert row["exact_match"] and itself.tokens == n
    assert sum(p > 0 for p in itself.proposed) >= 2
    assert itself.accepted == itself.proposed  # the same model proposes what it then verifies
    assert sum(a + 1 for a in itself.accepted) == n - 1  # every token after the prompt pass's first
    assert row["tau"] > 2


def make_head(target, directory, capture, draft_vocab, **variants):
    """A random head; ``variants`` (``norm_before_residual``, ``norm_before_fc``: the EAGLE-3 variants other
    pipelines train, which llama.cpp's graph also has) get norm weights far from 1, so an export that
    ignored or misplaced them drafts otherwise."""
    torch.manual_seed(0)
    config = EagleConfig.for_target(
        target, draft_vocab_size=draft_vocab, capture_layer_ids=capture and sorted(capture)
    )
    if capture:  # in the order given, as earlier versions saved heads (training now wants layer order)
        config.capture_layer_ids = list(capture)
    for key, value in variants.items():
        setattr(config, key, value)
    head = EagleHead(config)
    head.set_vocab_map(*build_vocab_map(torch.rand(target.vocab_size), config.draft_vocab_size))
    head.init_from_target(target.model)
    if variants:
        with torch.no_grad():
            for name, weight in head.named_parameters():
                if "norm" in name:
                    weight.copy_(torch.rand_like(weight) * 3 + 0.1)
    head.save_pretrained(directory)
    return head.eval()


def eagle3_args(head_gguf) -> list[str]:
    """llama-server flags: the head drafts K tokens per step, never stopping early (p_min 0), debug log on.
    (The server takes speculative settings from its command line; per-request ones are ignored.)"""
    return ["--spec-type", "draft-eagle3", "--spec-draft-model", str(head_gguf), "--spec-draft-n-max", str(K),
            "--spec-draft-p-min", "0", "-c", "256", "-lv", "5", "--log-colors", "off"]  # fmt: skip


DRAFT_LINE = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(\s*([\d.]+)\)")
TOP_K = 10
"""llama.cpp's EAGLE-3 drafter samples with top-k 10 and logs the top 3 with probabilities over those 10."""


def llamacpp_drafts(log: str) -> list[list[dict[int, float]]]:
    """Every chain llama.cpp drafted, from the server's debug log: per position {token: probability} of its
    top 3 candidates, the first key being the token it drafted."""
    chains: list[list[dict[int, float]]] = []
    for rank, pos, token, prob in DRAFT_LINE.findall(log):
        if int(rank) == 0:
            if int(pos) == 0:
                chains.append([])
            chains[-1].append({})
        chains[-1][-1][int(token)] = float(prob)
    return chains


def draftsmith_probs(target, head, context: list[int], chain: list[int]) -> list[torch.Tensor]:
    """draftsmith's draft distribution (top-10, renormalised, over target ids) at each position of ``chain``
    drafted after ``context`` (its last token not yet verified), fed llama.cpp's own draft tokens."""
    drafter = EagleDrafter(head)
    target.reset()
    target.set_capture(drafter.capture_layers)
    step = target.forward(torch.tensor(context[:-1]))
    drafter.begin(torch.tensor(context[:-1]), step.features)
    out = []
    with torch.inference_mode():
        hidden = drafter._catch_up(torch.tensor(context))
        for i, token in enumerate(chain):
            top = head.draft_logits(hidden)[-1].float().topk(TOP_K)
            probs = torch.zeros(head.config.vocab_size)
            probs[head.d2t[top.indices]] = top.values.softmax(-1)
            out.append(probs)
            hidden = drafter._step(hidden, torch.tensor([token]), drafter.cached_len + i)
    return out


def check_chain(theirs: list[dict[int, float]], ours: list[torch.Tensor]) -> None:
    """Same candidates with the same probabilities; llama.cpp's pick is draftsmith's (up to a float tie)."""
    for pos, (candidates, probs) in enumerate(zip(theirs, ours)):
        for token, p in candidates.items():
            assert abs(probs[token].item() - p) < 2e-3, (
                f"position {pos}: token {token} {probs[token]:.4f} vs {p}"
            )
        picked = next(iter(candidates))
        assert probs[picked] >= probs.max() - 2e-3, f"position {pos}: llama.cpp drafted {picked}"


VARIANTS = {"norm_before_residual": True, "norm_before_fc": True}


@pytest.mark.parametrize(
    ("capture", "draft_vocab", "variants"),
    [([5, 1, 3], 120, {}), ([1, 3, 5], None, {}), ([5, 1, 3], 120, VARIANTS)],
    ids=["unordered-layers", "full-vocab", "norm-variants"],
)
def test_llamacpp_drafts_with_the_eagle3_head_what_draftsmith_drafts(
    tiny, capture, draft_vocab, variants, tmp_path
):
    target = tiny["target"]
    head_dir = tmp_path / "head" / "draft"
    head = make_head(target, head_dir, capture, draft_vocab or target.vocab_size, **variants)
    gguf_file = export_checkpoint(
        locate_checkpoint(str(head_dir)), "gguf", tmp_path / "head.gguf", "f32", str(tiny["target_gguf"])
    )
    assert verify_export(gguf_file, "gguf")
    prompt = target.tokenizer(TEXTS[2], add_special_tokens=False).input_ids
    n = 40
    greedy = generate(target, torch.tensor(prompt), None, max_new_tokens=n).tokens
    log = tmp_path / "server.log"
    with llamacpp.Server(tiny["target_gguf"], eagle3_args(gguf_file), log=log) as server:
        out = server.complete(prompt, n)
    assert out["tokens"] == greedy  # llama.cpp's speculative output is the target's own
    chains = llamacpp_drafts(log.read_text(errors="replace"))
    # the server trims a chain that would run past n_predict, after it was drafted (and logged)
    assert sum(map(len, chains)) >= out["timings"]["draft_n"] > 0
    done = 1  # llama-server samples the first token from the prompt, then drafts after it
    for chain in chains:
        tokens = [next(iter(c)) for c in chain]
        check_chain(chain, draftsmith_probs(target, head, prompt + greedy[:done], tokens))
        accepted = next((i for i, t in enumerate(tokens) if t != greedy[done + i]), len(tokens))
        done += accepted + 1
    assert done >= n - 1  # every chain accounted for (the last token may come without one)


def test_without_the_fc_permutation_llamacpp_drafts_otherwise(tiny, tmp_path, monkeypatch):
    """The check above can fail: fc's columns left in the head's own layer order give other drafts."""
    target = tiny["target"]
    head = make_head(target, tmp_path / "head" / "draft", [5, 1, 3], 120)
    monkeypatch.setattr(gguf_export, "ascending_capture", lambda ids, fc: (sorted(ids), fc))
    gguf_file = export_checkpoint(
        locate_checkpoint(str(tmp_path / "head" / "draft")),
        "gguf",
        tmp_path / "h.gguf",
        "f32",
        str(tiny["target_gguf"]),
    )
    prompt = target.tokenizer(TEXTS[2], add_special_tokens=False).input_ids
    log = tmp_path / "server.log"
    with llamacpp.Server(tiny["target_gguf"], eagle3_args(gguf_file), log=log) as server:
        server.complete(prompt, 2 + K)
    first = llamacpp_drafts(log.read_text(errors="replace"))[0]
    greedy = generate(target, torch.tensor(prompt), None, max_new_tokens=1).tokens
    ours = draftsmith_probs(target, head, prompt + greedy, [next(iter(c)) for c in first])
    with pytest.raises(AssertionError, match="position"):
        check_chain(first, ours)
