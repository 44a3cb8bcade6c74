"""DSpark drafts (drafts/dspark.py, train/objectives/dspark.py): DFlash's block drafter with a Markov head, on
tiny random targets of three architectures."""

from __future__ import annotations

import json

import pytest
import torch
from test_dflash import (
    BOUND,
    SAMPLES,
    assert_refused,
    exact_distribution,
    max_normalised_deviation,
    sampled_continuations,
    walk_along_row,
)
from test_eagle import make_teacher, self_distilled_batch, train
from test_verify import verify_resampling_from_p
from tiny import tiny_target

import draftsmith.decode.speculative as speculative
from draftsmith.decode.sampling import Sampling, to_probs
from draftsmith.decode.speculative import generate
from draftsmith.drafts.base import build_drafter
from draftsmith.drafts.dflash import DFlashDrafter
from draftsmith.drafts.dspark import DSparkConfig, DSparkDraft, DSparkDrafter
from draftsmith.train.objective import Batch
from draftsmith.train.registry import build_objective

ARCHS = ["llama", "qwen3", "gemma2"]


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param, layers=4)


def markov_matters(draft: DSparkDraft, scale: float, seed: int, tokens: list[int] | None = None) -> None:
    """Noise of ``scale`` added to both of the Markov head's factors (to ``tokens``' rows of markov_w2 alone, if
    given): biases of order ``scale²·√r`` logits, so a drafter that ignored the head or chained it wrongly
    would draft otherwise."""
    generator = torch.Generator().manual_seed(seed)
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    rows = (
        torch.ones(w2.shape[0], 1)
        if tokens is None
        else torch.zeros(w2.shape[0], 1).index_fill_(0, torch.tensor(tokens), 1.0)
    )
    with torch.no_grad():
        w1.add_(scale * torch.randn(w1.shape, generator=generator))
        w2.add_(scale * torch.randn(w2.shape, generator=generator) * rows)


def trained(target, block_size: int = 8, steps: int = 40, **options):
    """A DSpark draft trained on the target's own greedy continuations (with the fixed slot decay these decoding
    tests were sized with, unless ``options`` say otherwise), its Markov head then given a bias far from zero, so a
    drafter that ignored it or chained it wrongly would draft otherwise."""
    batch = self_distilled_batch(target)
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    objective = build_objective(
        "dspark",
        target,
        {
            "block_size": block_size,
            "anchors_per_row": 16,
            "markov_rank": 8,
            "slot_weighting": "decay",
            **options,
        },
        counts,
    )
    teacher = make_teacher(target, batch, objective.capture_layers, 64)
    draft, losses, logs = train(objective, batch, teacher, steps=steps)
    assert (
        float(draft.markov_head.markov_w2.weight.detach().abs().max()) > 0
    )  # trained: no longer plain DFlash
    markov_matters(draft, 1.0, seed=3)
    return objective, draft, batch, teacher, losses


def test_greedy_output_is_the_targets_and_decoding_walks_as_validation_does(target):
    objective, draft, batch, teacher, losses = trained(target)
    assert losses[-1] < 0.8 * losses[0]
    drafter = DSparkDrafter(draft, target.model)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=24).tokens
    for k in (7, 2, 10, "auto"):
        assert generate(target, prompt, drafter, k, 24).tokens == reference, k
    # validation's walk chains the Markov bias as decoding does (each slot biased by the greedy token before it)
    chains = generate(target, prompt, drafter, 7, 24).accepted
    walk = walk_along_row(objective, draft, batch, teacher, 7)
    assert len(walk) >= 3 and chains[: len(walk)] == walk


def test_the_markov_head_chains_each_slot_on_the_draft_before_it():
    """A head whose bias after token t is +100 on t + 1 drafts t+1, t+2, t+3 after t; biasing every slot by the
    last committed token (or none) would not."""
    target = tiny_target("llama", layers=4)
    draft = DSparkDraft(DSparkConfig.for_target(target, block_size=4, markov_rank=target.vocab_size)).eval()
    V = target.vocab_size
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(V))
        draft.markov_head.markov_w2.weight.copy_(100 * torch.eye(V).roll(1, 0))  # row t+1 reads column t
    drafter = DSparkDrafter(draft, target.model)
    prompt = torch.tensor([5, 9, 2, 40])
    target.set_capture(drafter.capture_layers)
    target.reset()
    drafter.begin(prompt[:-1], target.forward(prompt[:-1]).features)
    proposal = drafter.propose(prompt, 3, Sampling(), None)
    assert proposal.tokens.tolist() == [41, 42, 43]
    target.set_capture(())


def test_training_logits_for_an_anchor_equal_the_decoders(target):
    """The objective's block (validation's previous tokens: the anchor, then the target's greedy ones) gives
    the logits the drafter gives each slot after the same previous tokens, to 1e-5."""
    objective, draft, batch, teacher, _ = trained(target, steps=5)
    row = Batch(batch.input_ids[:1], batch.attention_mask[:1], batch.loss_mask[:1])
    one = type(teacher)(
        {i: f[:1] for i, f in teacher.features.items()}, teacher.topk_logits[:1], teacher.topk_ids[:1]
    )
    for anchor in (6, 11):
        anchors = torch.tensor([[anchor]])
        previous = objective.slot_inputs(row, one, anchors, walk=True)["previous_tokens"][0, 0]
        train_logits = objective.block_logits(
            draft, row, one, anchors, torch.ones_like(anchors, dtype=torch.bool), walk=True
        )
        drafter = DSparkDrafter(draft, target.model)
        with torch.no_grad():
            drafter.begin(
                row.input_ids[0, :anchor], {i: one.features[i][0, :anchor] for i in drafter.capture_layers}
            )
            base = drafter.block_logits(int(row.input_ids[0, anchor]), anchor)
            decode_logits = base + draft.markov_head(previous).float()
        assert int(previous[0]) == int(row.input_ids[0, anchor])
        torch.testing.assert_close(train_logits[0, 0].float(), decode_logits, rtol=1e-5, atol=1e-5)


def test_a_draft_vocabulary_of_its_own_stays_lossless_and_biases_draft_ids(target):
    _, draft, batch, _, _ = trained(target, draft_vocab_size=120)
    assert draft.markov_head.markov_w2.weight.shape == (120, 8) and draft.markov_head.markov_w1.weight.shape[
        0
    ] == (target.vocab_size)
    prompt = batch.input_ids[0, :6]
    drafter = DSparkDrafter(draft, target.model)
    assert (
        generate(target, prompt, drafter, 7, 24).tokens
        == generate(target, prompt, None, max_new_tokens=24).tokens
    )


# ---- sampling: the committed tokens keep the target's distribution ----------------------------------


@pytest.fixture(scope="module")
def sampling_setup():
    """As DFlash's: a draft trained briefly on each continuation the target can sample after the prompt, its
    Markov head then made to matter."""
    target, prompt, batch = sampled_continuations()
    objective = build_objective("dspark", target, {"block_size": 4, "markov_rank": 4})
    draft, _, _ = train(objective, batch, make_teacher(target, batch, objective.capture_layers, 64), steps=15)
    exact = exact_distribution(target, prompt)
    # the bias reweighs the tokens the target can sample here: the draft's top-k stays among them (drafts are
    # accepted) while its distribution moves far from the unbiased one (hiding the bias shows)
    markov_matters(draft, 1.5, seed=6, tokens=sorted({t for seq in exact for t in seq}))
    return target, DSparkDrafter(draft, target.model), prompt, exact


def test_sampled_dspark_decoding_keeps_the_target_distribution(sampling_setup):
    target, drafter, prompt, exact = sampling_setup
    worst, accepted = max_normalised_deviation(target, drafter, prompt, exact)
    assert accepted > SAMPLES // 20 and worst < BOUND


def test_a_broken_rule_fails_the_same_test(sampling_setup, monkeypatch):
    target, drafter, prompt, exact = sampling_setup
    monkeypatch.setattr(speculative, "verify_sampled", verify_resampling_from_p)
    worst, _ = max_normalised_deviation(target, drafter, prompt, exact)
    assert worst > BOUND


@pytest.mark.slow
def test_proposals_that_hide_the_markov_bias_from_the_verify_rule_fail_the_same_test(
    sampling_setup, monkeypatch
):
    """Drafts drawn with the bias but reported as drawn from the unbiased logits: the verify rule then corrects
    toward the wrong law, which the test sees."""
    target, drafter, prompt, exact = sampling_setup

    honest = DSparkDrafter.choose

    def hiding(self, logits, last_token, sampling, generator):
        drafted, _ = honest(self, logits, last_token, sampling, generator)
        return drafted, to_probs(logits, sampling)

    monkeypatch.setattr(type(drafter), "choose", hiding)
    worst, _ = max_normalised_deviation(target, drafter, prompt, exact)
    assert worst > BOUND


# ---- options, targets, loading --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match", "needs_target"),
    [
        ({"markov_rank": 0}, "markov_rank", False),
        ({"markov_rank": 4096}, "markov_rank", False),
        ({"markov_rnk": 8}, "Did you mean 'markov_rank'", False),
        ({"block_size": 1}, "block_size must be >= 2, got 1", False),
        ({"capture_layer_ids": [2, 0]}, "write them as \\[0, 2\\]", True),
    ],
)
def test_bad_options_are_refused_naming_what_and_why(options, match, needs_target):
    assert_refused("dspark", options, match, needs_target)


def test_a_markov_rank_out_of_range_is_refused_by_the_config_too():
    for rank in (0, -1, 1025, 2.5, True):
        with pytest.raises(ValueError, match="markov_rank .* must be an integer in 1..1024"):
            DSparkConfig(markov_rank=rank)


def test_a_saved_draft_loads_as_a_dspark_drafter_and_is_refused_for_another_target(tmp_path):
    llama = tiny_target("llama", layers=4)
    DSparkDraft(DSparkConfig.for_target(llama, block_size=4, markov_rank=4)).save_pretrained(tmp_path / "d")
    drafter = build_drafter(str(tmp_path / "d"), llama)
    assert isinstance(drafter, DSparkDrafter) and drafter.draft.config.markov_rank == 4
    assert type(drafter) is not DFlashDrafter
    with pytest.raises(ValueError, match="DSpark draft was trained for target .* hidden_size differs"):
        build_drafter(str(tmp_path / "d"), tiny_target("llama", layers=4, hidden=48))


# ---- exports ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dspark_run(tmp_path_factory):
    target = tiny_target("llama", layers=4)
    counts = torch.arange(target.vocab_size).flip(0)
    objective = build_objective(
        "dspark", target, {"block_size": 8, "markov_rank": 4, "draft_vocab_size": 120}, counts
    )
    draft = objective.build_draft().eval()
    markov_matters(draft, 1.0, seed=5)
    run = tmp_path_factory.mktemp("dspark") / "draft"
    objective.save(draft, run)
    return target, draft, run


def test_exports_to_vllms_dspark_layout_its_verifier_reads(dspark_run, tmp_path):
    from safetensors.torch import load_file

    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint, verify_export

    target, draft, run = dspark_run
    out = export_checkpoint(locate_checkpoint(str(run)), "vllm", tmp_path / "vllm")
    assert verify_export(out, "vllm")[0].startswith("DSpark draft in ")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert (config["markov_rank"], config["block_size"], config["sample_from_anchor"]) == (4, 7, False)
    assert config["dflash_config"]["target_layer_ids"] == draft.config.capture_layer_ids
    tensors = load_file(out / "model.safetensors")
    torch.testing.assert_close(tensors["markov_head.markov_w1.weight"], draft.markov_head.markov_w1.weight)
    assert tensors["markov_head.markov_w2.weight"].shape == (120, 4) and tensors["d2t"].shape == (120,)


@pytest.mark.parametrize(
    ("break_it", "problem"),
    [
        (lambda c, t: c.pop("markov_rank"), "markov_rank None"),
        (lambda c, t: c.update(sample_from_anchor=True), "sample_from_anchor True"),
        (lambda c, t: t.pop("markov_head.markov_w2.weight"), "missing markov_head.markov_w2.weight"),
        (
            lambda c, t: c.update(markov_rank=8),
            "markov_head.markov_w1.weight is \\[259, 4\\], vLLM builds \\[259, 8\\]",
        ),
        (lambda c, t: t.pop("fc.weight"), "missing fc.weight"),
    ],
)
def test_the_vllm_verifier_refuses_what_vllms_dspark_loader_would_misread(
    dspark_run, tmp_path, break_it, problem
):
    from safetensors.torch import load_file, save_file

    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint, verify_export
    from draftsmith.export.verify import ExportVerificationError

    out = export_checkpoint(locate_checkpoint(str(dspark_run[2])), "vllm", tmp_path / "vllm")
    config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    break_it(config, tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ExportVerificationError, match=problem):
        verify_export(out, "vllm")


@pytest.mark.parametrize("engine", ["sglang", "speculators"])
def test_engines_without_a_dspark_layout_refuse_it(dspark_run, tmp_path, engine):
    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint

    with pytest.raises(ValueError, match="DSpark draft"):
        export_checkpoint(locate_checkpoint(str(dspark_run[2])), engine, tmp_path / engine)
    assert not (tmp_path / engine).exists()
