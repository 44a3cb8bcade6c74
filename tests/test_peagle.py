"""P-EAGLE heads (drafts/peagle.py, train/objectives/peagle.py) on tiny random targets."""

from __future__ import annotations

import json

import pytest
import torch
from test_dflash import SAMPLING, assert_refused, exact_distribution, max_normalised_deviation, walk_along_row
from test_eagle import make_teacher, self_distilled_batch, train
from test_verify import verify_resampling_from_p
from tiny import tiny_target, train_debug_recipe

import draftsmith.decode.speculative as speculative
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.speculative import generate
from draftsmith.drafts.base import build_drafter
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.peagle import ParallelEagleDrafter
from draftsmith.train.objective import Batch
from draftsmith.train.registry import build_objective

ARCHS = ["llama", "qwen3", "gemma2"]
DEPTHS = 6


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return tiny_target(request.param, layers=4)


def trained(target, steps: int = 80, **options):
    """A head trained on the target's own greedy continuations (so decoding accepts some of its drafts)."""
    batch = self_distilled_batch(target)
    counts = torch.bincount(batch.input_ids[batch.loss_mask.bool()], minlength=target.vocab_size)
    objective = build_objective("peagle", target, {"parallel_depths": DEPTHS, "draft_vocab_size": 200, **options},
                                counts)  # fmt: skip
    teacher = make_teacher(target, batch, objective.capture_layers, 64)
    head, losses, logs = train(objective, batch, teacher, steps=steps)
    return objective, head, batch, teacher, losses, logs


@pytest.fixture(scope="module")
def trained_head(target):
    return trained(target)


def test_greedy_output_is_the_targets_and_parallel_drafts_are_accepted(target, trained_head):
    objective, head, batch, teacher, losses, logs = trained_head
    assert losses[-1] < 0.8 * losses[0] and {"acc_0", "acc_1", "tokens", "slots"} <= set(logs)
    drafter = ParallelEagleDrafter(head)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=24).tokens
    for k in (DEPTHS, 2, DEPTHS + 3, "auto"):
        result = generate(target, prompt, drafter, k, 24)
        assert result.tokens == reference, k
        assert max(result.proposed, default=0) <= DEPTHS  # one forward drafts parallel_depths at most
    # Decoding accepts, step by step, what validation's walk along this very continuation predicts (the τ
    # training reports), slots (depth >= 1) among them, and more than an untrained head. A label shift is
    # tests/test_label_alignment.py's: on a continuation this repetitive a head one token off is accepted too.
    full = generate(target, prompt, drafter, DEPTHS, 24).accepted
    walk = walk_along_row(objective, head, batch, teacher, DEPTHS)
    assert len(walk) >= 3 and full[: len(walk)] == walk and any(a > 1 for a in walk)
    untrained = generate(target, prompt, ParallelEagleDrafter(objective.build_draft().eval()), DEPTHS, 24)
    assert untrained.tokens == reference and sum(walk) > sum(untrained.accepted)
    assert not drafter.supports_tree


def test_an_end_of_sequence_inside_the_drafts_ends_the_output_where_the_target_does(target, trained_head):
    _, head, batch, _, _, _ = trained_head
    drafter = ParallelEagleDrafter(head)
    prompt = batch.input_ids[0, :6]
    reference = generate(target, prompt, None, max_new_tokens=24).tokens
    saved = target.eos_ids
    try:
        for cut in (3, 9):
            target.eos_ids = {reference[cut]}
            expected = generate(target, prompt, None, max_new_tokens=24)
            result = generate(target, prompt, drafter, DEPTHS, 24)
            assert result.tokens == expected.tokens and result.stopped_by == expected.stopped_by == "eos"
    finally:
        target.eos_ids = saved


def training_logits(head, batch: Batch, teacher, anchor: int, n: int) -> torch.Tensor:
    """The training forward's logits [n, Vd] of the real pair at ``anchor`` and its slots at depths 1..n-1."""
    anchors = torch.full((1, n - 1), anchor)
    depths = torch.arange(1, n)[None]
    with torch.no_grad():
        out = head(batch.input_ids, teacher.features, batch.attention_mask, position_ids=batch.position_ids,
                   slots=(anchors, depths, torch.ones_like(anchors, dtype=torch.bool)))  # fmt: skip
    hidden = out.hidden_states[0][0]
    T = batch.input_ids.shape[1]
    return head.draft_logits(torch.cat([hidden[anchor : anchor + 1], hidden[T:]])).float()


def test_training_logits_for_an_anchor_equal_the_decoders(target, trained_head):
    _, head, batch, teacher, _, _ = trained_head
    row = Batch(batch.input_ids[:1], batch.attention_mask[:1], batch.loss_mask[:1])
    features = {i: f[:1] for i, f in teacher.features.items()}
    plain = Sampling(temperature=1.0)  # proposals then carry softmax(logits) over the target's vocabulary
    for anchor in (6, 11):
        want = training_logits(head, row, type(teacher)(features), anchor, DEPTHS).softmax(-1)
        drafter = ParallelEagleDrafter(head)
        drafter.begin(row.input_ids[0, : anchor + 1], {i: f[0, : anchor + 1] for i, f in features.items()})
        proposal = drafter.propose(
            row.input_ids[0, : anchor + 2], DEPTHS, plain, torch.Generator().manual_seed(0)
        )
        torch.testing.assert_close(proposal.probs[:, head.d2t], want, rtol=1e-5, atol=1e-6)


def test_packed_rows_see_only_their_own_conversation(target, trained_head):
    """Slots in the second conversation of a packed row give the logits they give in a row of their own."""
    objective, head, batch, _, _, _ = trained_head
    a, b = batch.input_ids[0, :14], batch.input_ids[1, :12]
    packed = torch.cat([a, b])[None]
    positions = torch.cat([torch.arange(14), torch.arange(12)])[None]
    ones = torch.ones_like(packed)
    alone = Batch(b[None], torch.ones_like(b[None]), torch.ones_like(b[None]))
    layers = objective.capture_layers
    t_packed = make_teacher(target, Batch(packed, ones, ones), layers, 4)
    t_alone = make_teacher(target, alone, layers, 4)
    for i in layers:  # the packed teacher's second half: the second conversation's own features
        t_packed.features[i][0, 14:] = t_alone.features[i][0]
    got = training_logits(head, Batch(packed, ones, ones, positions), t_packed, 14 + 7, 4)
    want = training_logits(head, alone, t_alone, 7, 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_depth_sampling_nests_each_anchors_slots():
    """Every anchor with a slot at depth d has its slots at 1..d-1, at eligible anchors only, fewer per depth."""
    from draftsmith.train.objectives.common import step_valid_masks

    target = tiny_target("llama", layers=4)
    batch = self_distilled_batch(target, n=3)
    objective = build_objective(
        "peagle", target, {"parallel_depths": 5, "depth_ratio": 0.5, "depth_ratio_min": 0.2}
    )
    eligible = step_valid_masks(batch, 2)[1]
    anchors, depths, keep = objective.sample_slots(batch)
    for b in range(anchors.shape[0]):
        per_depth = [set(anchors[b][keep[b] & (depths[b] == d)].tolist()) for d in range(1, 5)]
        assert per_depth[0] <= set(eligible[b].nonzero().flatten().tolist())
        assert all(deeper <= shallower for shallower, deeper in zip(per_depth, per_depth[1:]))
        sizes = [len(s) for s in per_depth]
        assert (
            sizes == sorted(sizes, reverse=True)
            and sizes[-1] >= 1
            and sizes[0] == -(-int(eligible[b].sum()) // 2)
        )


# ---- sampling: the committed tokens keep the target's distribution ----------------------------------


@pytest.fixture(scope="module")
def sampling_setup():
    """A head trained briefly on each continuation the target can sample after the prompt: its drafts overlap
    the target's top-k without matching it, so drafts are accepted and rejected, and a wrong residual shows."""
    from draftsmith.decode.sampling import to_probs

    target = tiny_target("llama", layers=4)
    target.eos_ids = set()
    prompt = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(1))
    target.reset()
    firsts = to_probs(target.forward(prompt).logits[-1], SAMPLING).nonzero().view(-1).tolist()
    rows = []
    for first in firsts:
        start = torch.cat([prompt, torch.tensor([first])])
        rows.append(torch.cat([start, torch.tensor(generate(target, start, None, max_new_tokens=8).tokens)]))
    ids = torch.stack(rows)
    learnt = torch.zeros_like(ids)
    learnt[:, len(prompt) :] = 1
    batch = Batch(ids, torch.ones_like(ids), learnt)
    objective = build_objective("peagle", target, {"parallel_depths": 4, "draft_vocab_size": 259})
    head, _, _ = train(objective, batch, make_teacher(target, batch, objective.capture_layers, 64), steps=15)
    return target, ParallelEagleDrafter(head), prompt, exact_distribution(target, prompt)


def test_sampled_parallel_decoding_keeps_the_target_distribution(sampling_setup):
    target, drafter, prompt, exact = sampling_setup
    worst, accepted = max_normalised_deviation(target, drafter, prompt, exact)
    assert accepted > 0 and worst < 4.5  # drafts were accepted, and the law is the target's


def test_a_broken_rule_fails_the_same_test(sampling_setup, monkeypatch):
    target, drafter, prompt, exact = sampling_setup
    monkeypatch.setattr(speculative, "verify_sampled", verify_resampling_from_p)
    worst, _ = max_normalised_deviation(target, drafter, prompt, exact)
    assert worst > 4.5


# ---- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match", "needs_target"),
    [
        ({"parallel_depths": 1}, "parallel_depths must be >= 2", False),
        ({"parallel_depths": 33}, "parallel_depths must be <= 32", False),
        ({"mask_token_id": 259}, "mask_token_id 259 is not a token of the target's vocabulary", True),
        ({"mask_token_id": -1}, "mask_token_id -1", True),
        ({"capture_layer_ids": [0, 9, 2]}, "\\[9\\] outside 0..3 for a target with 4 decoder layers", True),
        ({"depth_ratio": 0}, "depth_ratio must be > 0", False),
        ({"paralel_depths": 4}, "Did you mean 'parallel_depths'", False),
    ],
)
def test_bad_options_are_refused_naming_what_and_why(options, match, needs_target):
    assert_refused("peagle", options, match, needs_target)


def test_a_head_for_another_target_or_a_chain_head_is_refused(tmp_path):
    llama = tiny_target("llama", layers=4)
    objective = build_objective("peagle", llama, {"draft_vocab_size": 259})
    objective.save(objective.build_draft().eval(), tmp_path / "p")
    assert isinstance(build_drafter(str(tmp_path / "p"), llama), ParallelEagleDrafter)
    with pytest.raises(ValueError, match="trained for target .* hidden_size differs"):
        build_drafter(str(tmp_path / "p"), tiny_target("llama", layers=4, hidden=48))
    chain = EagleHead(EagleConfig.for_target(llama, draft_vocab_size=259))
    with pytest.raises(ValueError, match="not a P-EAGLE head: it records no mask_token_id"):
        ParallelEagleDrafter(chain)


def test_trains_in_the_loop_and_loads_as_a_drafter(tmp_path):
    """The debug recipe through the one loop on a tiny saved target; the run loads as a P-EAGLE drafter."""
    train_debug_recipe(tmp_path, "debug_peagle.yaml", "--draft.options.draft_vocab_size=200")
    loaded = tiny_target("llama", layers=4)
    drafter = build_drafter(str(tmp_path / "run"), loaded)
    assert isinstance(drafter, ParallelEagleDrafter) and drafter.max_k == 6
    prompt = torch.tensor([3, 1, 4, 1, 5])
    assert generate(loaded, prompt, drafter, 6, 16).tokens == generate(loaded, prompt, None, 0, 16).tokens


# ---- exports ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peagle_run(tmp_path_factory):
    target = tiny_target("llama", layers=8)
    counts = torch.arange(target.vocab_size).flip(0)  # low ids most frequent
    objective = build_objective(
        "peagle", target, {"draft_vocab_size": 100, "capture_layer_ids": [1, 4, 6]}, counts
    )
    # in another order, as earlier versions saved heads: export puts them in layer order
    objective.config.capture_layer_ids = [4, 1, 6]
    run = tmp_path_factory.mktemp("peagle")
    head = objective.build_draft().eval()
    with torch.no_grad():  # norms off one, so a mapping slip between two of them shows
        for name, param in head.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    objective.save(head, run / "draft")
    return target, run


def test_exports_to_vllm_and_speculators_with_mask_hidden_and_other_engines_refuse(
    peagle_run, tmp_path, capsys
):
    from safetensors.torch import load_file

    from draftsmith.cli import main
    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint, verify_export

    target, run = peagle_run
    saved = load_file(run / "draft" / "model.safetensors")["mask_hidden"]
    H = target.config.hidden_size
    ascending = torch.cat([saved[H : 2 * H], saved[:H], saved[2 * H :]])  # trained on [4, 1, 6]: to [1, 4, 6]
    vllm = export_checkpoint(locate_checkpoint(str(run)), "vllm", tmp_path / "vllm")
    assert verify_export(vllm, "vllm")
    config = json.loads((vllm / "config.json").read_text())
    assert config["mask_token_id"] == 256 and config["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]
    assert torch.equal(load_file(vllm / "model.safetensors")["mask_hidden"], ascending.view(1, 1, 3 * H))
    spec = export_checkpoint(locate_checkpoint(str(run)), "speculators", tmp_path / "spec")
    assert verify_export(spec, "speculators")
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == 256
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 8
    assert main(["export", str(run), "--to", "gguf", "--out", str(tmp_path / "p.gguf")]) == 2
    assert "would run the head as the chain head" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("engine", "break_it", "problem"),
    [
        ("vllm", lambda c, t: t.pop("mask_hidden"), "weight mask_hidden missing"),
        ("vllm", lambda c, t: t.update(mask_hidden=torch.zeros(1, 1, 7)), "mask_hidden has shape"),
        ("vllm", lambda c, t: c.update(mask_token_id=10**6), "mask_token_id 1000000"),
        # said to be EAGLE-3, it is checked as one: vLLM would load it without its parallel slots
        (
            "speculators",
            lambda c, t: c.update(speculators_model_type="eagle3"),
            "weight mask_hidden is not one",
        ),
        ("speculators", lambda c, t: c.pop("mask_token_id"), "mask_token_id missing"),
        ("speculators", lambda c, t: t.pop("mask_hidden"), "weight mask_hidden missing"),
    ],
)
def test_the_verifiers_refuse_a_parallel_head_vllm_would_run_wrong(
    peagle_run, tmp_path, engine, break_it, problem
):
    from test_dflash import broken_export

    from draftsmith.export.verify import ExportVerificationError, verify_export

    out = broken_export(peagle_run[1], engine, tmp_path / engine, break_it)
    with pytest.raises(ExportVerificationError, match=problem):
        verify_export(out, engine)


@pytest.mark.slow
def test_greedy_output_equals_the_real_targets(tmp_path):
    """A P-EAGLE head for the bundled target, trained for a minute on its own answers, decodes them to the
    target's own tokens with parallel drafts accepted (tests/test_vllm.py serves such a head in vLLM)."""
    from test_dflash import self_trained

    from draftsmith.decode.target import load_target

    target = load_target("smollm2-135m-instruct", device="cpu", dtype="float32")
    made = self_trained("peagle", target, tmp_path / "draft", parallel_depths=DEPTHS, draft_vocab_size=8192)
    drafter = build_drafter(str(tmp_path / "draft"), target)
    walks = made.walks(DEPTHS)
    for prompt, walk in zip(made.prompts, walks):
        result = generate(target, prompt, drafter, DEPTHS, 48)
        assert result.tokens == generate(target, prompt, None, max_new_tokens=48).tokens
        # the saved head, decoding, accepts step by step what validation's walk along this answer predicts
        assert result.accepted[: len(walk)] == walk, (result.accepted, walk)
    assert sum(a > 1 for walk in walks for a in walk) > 0  # slots, not only the real pair, are accepted


@pytest.mark.engine
def test_specforges_peagle_class_reads_our_sglang_export_and_gives_our_logits(peagle_run, tmp_path):
    """SpecForge 0.2.0's own PEagleDraftModel (the folder its exporter gives SGLang) loads ``--to sglang`` strictly
    and, run causally over the real pairs and three mask slots, gives draftsmith's drafter's logits (1e-5)."""
    import os
    import subprocess
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from test_peer_heads import peer_python

    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint, verify_export

    python = peer_python("specforge")
    target, run = peagle_run
    out = export_checkpoint(locate_checkpoint(str(run)), "sglang", tmp_path / "sglang")
    assert verify_export(out, "sglang")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["PEagleDraftModel"]
    head = build_drafter(str(run), target).head
    T, n = 11, 4
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(5))
    teacher = make_teacher(
        target, Batch(ids, torch.ones_like(ids), torch.ones_like(ids)), head.config.capture_layer_ids, 4
    )
    ours = training_logits(head, Batch(ids, torch.ones_like(ids), torch.ones_like(ids)), teacher, T - 2, n)
    ascending = sorted(head.config.capture_layer_ids)
    io = {"context": torch.cat([teacher.features[i][:, : T - 1] for i in ascending], -1).contiguous(),
          "ids": ids[:, 1:].contiguous(), "slots": torch.tensor(n - 1)}  # fmt: skip
    save_file(io, str(tmp_path / "io.safetensors"))
    worker = Path(__file__).with_name("peer_peagle_worker.py")
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([str(python), str(worker), str(out), str(tmp_path / "io.safetensors"),
                           str(tmp_path / "out.safetensors")], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"SpecForge worker failed:\n{done.stderr[-3000:]}"
    torch.testing.assert_close(
        load_file(str(tmp_path / "out.safetensors"))["logits"], ours, rtol=1e-5, atol=1e-5
    )
