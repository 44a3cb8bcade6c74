"""llama.cpp, run for real, judges the DSpark GGUF export: its ``dflash`` graph with the Markov head drafts
every block draftsmith's DSpark drafter drafts, slot by slot (each biased by the draft before it).

Needs the optional build (``bash scripts/install_llamacpp.sh``); skipped without it. The target and its GGUF
are tests/test_llamacpp_dflash.py's; the draft is trained a few steps on the target's own continuations and its
Markov head then given biases far from zero, so a graph that ignored the head, or chained it otherwise, would
draft other blocks.
"""

from __future__ import annotations

import pytest
import torch
from test_dspark import trained
from test_llamacpp import llamacpp_drafts
from test_llamacpp_dflash import (  # noqa: F401  (tiny: the fixture)
    BLOCK,
    N,
    block_after,
    dflash_args,
    served_blocks_as_draftsmiths,
    tiny,
    top_probs,
)

from draftsmith import llamacpp
from draftsmith.decode.speculative import generate
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts.dspark import DSparkDrafter
from draftsmith.export import export_checkpoint
from draftsmith.export import gguf_dflash as dflash_gguf
from draftsmith.export.verify import verify_export

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not llamacpp.available(), reason=f"llama.cpp is not built (optional extra: {llamacpp.INSTALL})"
    ),
]


@pytest.fixture(scope="module", params=[None, 120], ids=["target-vocab", "draft-vocab"])
def dspark(tiny, request):  # noqa: F811
    """A DSpark draft trained on the target's own continuations, saved and exported to an F32 GGUF."""
    target, root = tiny["target"], tiny["root"]
    options = {} if request.param is None else {"draft_vocab_size": request.param}
    _, draft, batch, _, _ = trained(target, BLOCK, **options)
    draft_dir = root / f"dspark-{request.param}" / "draft"
    draft.save_pretrained(draft_dir)
    gguf_file = export_checkpoint(
        locate_checkpoint(str(draft_dir)), "gguf", root / f"dspark-{request.param}.gguf", "f32",
        str(tiny["target_gguf"]),
    )  # fmt: skip
    return {"draft": draft.eval(), "gguf": gguf_file, "prompt": batch.input_ids[0, :6].tolist()}


def draftsmith_probs(target, draft, context: list[int]) -> list[torch.Tensor]:
    """draftsmith's DSpark block after ``context`` (its last token not yet verified): per slot, the top-10
    distribution over target ids of the logits biased by the greedy draft before it (the last token for slot
    1), which llama.cpp's drafter samples from."""
    base = block_after(target, DSparkDrafter(draft, target.model), context)
    previous, out = torch.tensor([context[-1]]), []
    with torch.inference_mode():
        for row in base:
            biased = row + draft.markov_head(previous)[0].float()
            out.append(top_probs(draft, biased))
            previous = draft.to_target_ids(biased.argmax(-1, keepdim=True))
    return out


def served_chains(tiny, gguf_file, prompt, tmp_path):  # noqa: F811
    log = tmp_path / "server.log"
    with llamacpp.Server(tiny["target_gguf"], dflash_args(gguf_file), log=log) as server:
        out = server.complete(prompt, N)
    return out, llamacpp_drafts(log.read_text(errors="replace"))


def test_llamacpp_drafts_with_the_dspark_draft_what_draftsmith_drafts(tiny, dspark, tmp_path):  # noqa: F811
    target, draft, prompt = tiny["target"], dspark["draft"], dspark["prompt"]
    assert verify_export(dspark["gguf"], "gguf")
    greedy = generate(target, torch.tensor(prompt), None, max_new_tokens=N).tokens
    ours = generate(target, torch.tensor(prompt), DSparkDrafter(draft, target.model), BLOCK - 1, N)
    assert ours.tokens == greedy
    out, chains = served_chains(tiny, dspark["gguf"], prompt, tmp_path)
    assert out["tokens"] == greedy  # llama.cpp's speculative output is the target's own
    assert chains and all(len(c) == BLOCK - 1 for c in chains)
    accepted = served_blocks_as_draftsmiths(chains, greedy, lambda context: draftsmith_probs(target, draft, context),
                                            prompt)  # fmt: skip
    assert accepted[:-1] == ours.accepted[: len(accepted) - 1]
    timings = out["timings"]
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (sum(ours.proposed), sum(ours.accepted))


def test_without_the_markov_head_llamacpp_drafts_otherwise(tiny, dspark, tmp_path, monkeypatch):  # noqa: F811
    """The same draft exported with its Markov tensors dropped (plain DFlash to llama.cpp): the blocks differ
    from draftsmith's DSpark blocks, so the test above sees the head."""
    target, draft, prompt = tiny["target"], dspark["draft"], dspark["prompt"]
    plain = dflash_gguf.dflash_tensors

    def no_markov(weights, config):
        return plain({n: t for n, t in weights.items() if not n.startswith("markov_head.")}, config)

    monkeypatch.setattr(dflash_gguf, "dflash_tensors", no_markov)
    draft_dir = tiny["root"] / "dspark-plain" / "draft"
    draft.save_pretrained(draft_dir)
    gguf_file = export_checkpoint(locate_checkpoint(str(draft_dir)), "gguf", tmp_path / "plain.gguf", "f32",
                                  str(tiny["target_gguf"]))  # fmt: skip
    greedy = generate(target, torch.tensor(prompt), None, max_new_tokens=N).tokens
    _, chains = served_chains(tiny, gguf_file, prompt, tmp_path)
    first = [next(iter(c)) for c in chains[0]]
    ours = [int(probs.argmax()) for probs in draftsmith_probs(target, draft, prompt + greedy[:1])]
    assert first != ours
