"""llama.cpp, run for real, judges the DFlash GGUF export: every block it drafts is draftsmith's drafter's.

Needs the optional build (``bash scripts/install_llamacpp.sh``); skipped without it. The target is the tiny
random-init Llama of tests/test_llamacpp.py (an F32 GGUF written by draftsmith, the same model for both
engines); the drafts are trained a few steps on the target's own continuations, so some blocks are accepted.
"""

from __future__ import annotations

import pytest
import torch
from test_dflash import trained
from test_llamacpp import TOP_K, check_chain, llamacpp_drafts
from tiny import tiny_bpe_target_gguf

from draftsmith import llamacpp
from draftsmith.decode.speculative import generate
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts.dflash import DFlashDrafter
from draftsmith.export import export_checkpoint
from draftsmith.export import gguf_dflash as dflash_gguf
from draftsmith.export.verify import verify_export

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not llamacpp.available(), reason=f"llama.cpp is not built (optional extra: {llamacpp.INSTALL})"
    ),
]

BLOCK = 8
N = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp_dflash")
    target, target_gguf = tiny_bpe_target_gguf(root)
    return {"root": root, "target": target, "target_gguf": target_gguf}


@pytest.fixture(scope="module", params=[None, 120], ids=["target-vocab", "draft-vocab"])
def dflash(tiny, request):
    """A DFlash draft trained on the target's own continuations, saved and exported to an F32 GGUF."""
    target, root = tiny["target"], tiny["root"]
    options = {} if request.param is None else {"draft_vocab_size": request.param}
    _, draft, batch, _, _, _ = trained(target, BLOCK, **options)
    draft_dir = root / f"dflash-{request.param}" / "draft"
    draft.save_pretrained(draft_dir)
    gguf_file = export_checkpoint(
        locate_checkpoint(str(draft_dir)), "gguf", root / f"dflash-{request.param}.gguf", "f32",
        str(tiny["target_gguf"]),
    )  # fmt: skip
    return {
        "draft": draft.eval(),
        "dir": draft_dir,
        "gguf": gguf_file,
        "prompt": batch.input_ids[0, :6].tolist(),
    }


def dflash_args(draft_gguf, k: int = BLOCK - 1) -> list[str]:
    """llama-server flags: a whole block (k = block size - 1), never stopping early (p_min 0), debug log on."""
    return [*llamacpp.speculative_args("dflash", k, draft_gguf), "-c", "256", "-lv", "5"]


def draftsmith_probs(target, draft, context: list[int]) -> list[torch.Tensor]:
    """draftsmith's block after ``context`` (its last token not yet verified): per slot the top-10
    distribution over target ids llama.cpp's drafter samples from."""
    return [top_probs(draft, row) for row in block_after(target, DFlashDrafter(draft, target.model), context)]


def block_after(target, drafter, context: list[int]) -> torch.Tensor:
    """The drafter's block logits [Q - 1, Vd] after ``context``, its last token not yet verified."""
    target.reset()
    target.set_capture(drafter.capture_layers)
    with torch.inference_mode():
        step = target.forward(torch.tensor(context[:-1]))
        drafter.begin(torch.tensor(context[:-1]), step.features)
        return drafter.block_logits(context[-1], len(context) - 1)


def top_probs(draft, logits: torch.Tensor) -> torch.Tensor:
    """The top-10 distribution over target ids llama.cpp's drafter samples from, of one slot's logits."""
    top = logits.topk(TOP_K)
    probs = torch.zeros(draft.config.vocab_size)
    probs[draft.to_target_ids(top.indices)] = top.values.softmax(-1)
    return probs


def served_blocks_as_draftsmiths(chains, greedy: list[int], probs_after, prompt: list[int]) -> list[int]:
    """Check every block llama.cpp logged against draftsmith's (``probs_after(context)``: per slot the top-10
    distribution) after the tokens it had then, and return how many of each it accepted."""
    done, accepted = 1, []  # llama-server samples the first token from the prompt, then drafts after it
    for chain in chains:
        tokens = [next(iter(c)) for c in chain]
        check_chain(chain, probs_after(prompt + greedy[:done]))
        accepted.append(next((i for i, t in enumerate(tokens) if t != greedy[done + i]), len(tokens)))
        done += accepted[-1] + 1
        if done >= N:
            break
    return accepted


def test_llamacpp_drafts_with_the_dflash_draft_what_draftsmith_drafts(tiny, dflash, tmp_path):
    target, draft, prompt = tiny["target"], dflash["draft"], dflash["prompt"]
    assert verify_export(dflash["gguf"], "gguf")
    greedy = generate(target, torch.tensor(prompt), None, max_new_tokens=N).tokens
    ours = generate(target, torch.tensor(prompt), DFlashDrafter(draft, target.model), BLOCK - 1, N)
    assert ours.tokens == greedy and sum(ours.accepted) > 0
    log = tmp_path / "server.log"
    with llamacpp.Server(tiny["target_gguf"], dflash_args(dflash["gguf"]), log=log) as server:
        out = server.complete(prompt, N)
    assert out["tokens"] == greedy  # llama.cpp's speculative output is the target's own
    chains = llamacpp_drafts(log.read_text(errors="replace"))
    assert chains and all(len(c) == BLOCK - 1 for c in chains)  # one whole block per step
    accepted = served_blocks_as_draftsmiths(chains, greedy, lambda context: draftsmith_probs(target, draft, context),
                                            prompt)  # fmt: skip
    # the same blocks accepted step by step as in draftsmith's decoder, which also drafts no more than the
    # tokens left to make (the server trims its last blocks to n_predict, after they were drafted and logged)
    assert accepted[:-1] == ours.accepted[: len(accepted) - 1] and sum(accepted) > 0
    timings = out["timings"]
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (sum(ours.proposed), sum(ours.accepted))


def test_without_the_layer_id_shift_llamacpp_drafts_otherwise(tiny, dflash, tmp_path, monkeypatch):
    """The check above can fail: target_layers written in draftsmith's convention (output of layer i) make
    llama.cpp feed the draft the input of layer i instead, and its blocks differ."""
    fields = dflash_gguf.dflash_fields

    def unshifted(config):
        return fields({**config, "capture_layer_ids": [i - 1 for i in config["capture_layer_ids"]]})

    monkeypatch.setattr(dflash_gguf, "dflash_fields", unshifted)
    target, draft, prompt = tiny["target"], dflash["draft"], dflash["prompt"]
    file = export_checkpoint(locate_checkpoint(str(dflash["dir"])), "gguf", tmp_path / "d.gguf", "f32",
                             str(tiny["target_gguf"]))  # fmt: skip
    log = tmp_path / "server.log"
    with llamacpp.Server(tiny["target_gguf"], dflash_args(file), log=log) as server:
        server.complete(prompt, 2 + BLOCK)
    first = llamacpp_drafts(log.read_text(errors="replace"))[0]
    greedy = generate(target, torch.tensor(prompt), None, max_new_tokens=1).tokens
    with pytest.raises(AssertionError, match="position"):
        check_chain(first, draftsmith_probs(target, draft, prompt + greedy))


def test_a_shorter_block_in_llamacpp_drafts_otherwise(tiny, dflash, tmp_path):
    """llama.cpp decodes a block of --spec-draft-n-max + 1 tokens; below block size - 1 the slots attend to
    fewer masks than in training, so its drafts are not draftsmith's (hence k = block size - 1 in the bench)."""
    target, draft, prompt = tiny["target"], dflash["draft"], dflash["prompt"]
    log = tmp_path / "server.log"
    with llamacpp.Server(tiny["target_gguf"], dflash_args(dflash["gguf"], 3), log=log) as server:
        server.complete(prompt, 2 + BLOCK)
    first = llamacpp_drafts(log.read_text(errors="replace"))[0]
    assert len(first) == 3
    greedy = generate(target, torch.tensor(prompt), None, max_new_tokens=1).tokens
    with pytest.raises(AssertionError, match="position"):
        check_chain(first, draftsmith_probs(target, draft, prompt + greedy))
