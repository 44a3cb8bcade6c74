"""Prepacked oneDNN linears for CPU decoding (decode/cpu_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_target

from draftsmith.decode.cpu_kernels import (
    Int8Linear,
    PackedLinear,
    int8_unavailable,
    pack_for_decoding,
    pack_linears,
    packing_unavailable,
    quantize_draft_linears,
    unpack_linears,
    unquantize_linears,
)
from draftsmith.decode.speculative import generate
from draftsmith.drafts import build_drafter
from draftsmith.drafts.distill import from_target_layers
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.model_drafter import ModelDrafter

needs_int8 = pytest.mark.skipif(int8_unavailable("cpu") is not None, reason="no int8 weight-only matmul")

pytestmark = pytest.mark.skipif(
    packing_unavailable("cpu", torch.float32) is not None, reason="no oneDNN linear in this PyTorch"
)


def _frozen(model):
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_model_gives_the_same_logits_and_state_dict(arch):
    model = _frozen(tiny_model(arch))
    ids = torch.randint(0, 259, (2, 19))
    with torch.no_grad():
        before = model(ids).logits
    keys = list(model.state_dict())
    n = pack_linears(model)
    assert n == sum(1 for m in model.modules() if isinstance(m, PackedLinear)) > 0
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert list(model.state_dict()) == keys  # the packed copy never reaches a checkpoint
    assert pack_linears(model) == 0  # idempotent
    assert unpack_linears(model) == n
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_trainable_layers_are_left_alone_and_packed_layers_refuse_autograd():
    model = tiny_model("llama").requires_grad_(True)
    assert pack_linears(model) == 0
    linear = torch.nn.Linear(8, 4)
    packed = PackedLinear(linear)
    with pytest.raises(RuntimeError, match="inference only"):
        packed(torch.randn(3, 8))
    with torch.no_grad():
        torch.testing.assert_close(packed(torch.randn(3, 8) * 0), linear.bias.expand(3, 4))


def test_an_in_place_weight_update_is_picked_up():
    linear = torch.nn.Linear(8, 4, bias=False).requires_grad_(False)
    packed = PackedLinear(linear)
    x = torch.randn(2, 8)
    linear.weight.mul_(3.0)
    torch.testing.assert_close(packed(x), x @ linear.weight.T, atol=1e-5, rtol=1e-5)


def test_shared_linears_are_packed_once():
    target = tiny_target("llama")
    drafter = build_drafter("layers:2", target)  # a view sharing the target's modules
    pack_for_decoding(target.model, drafter)
    head_t = target.model.get_output_embeddings()
    head_d = drafter.model.get_output_embeddings()
    assert isinstance(head_t, PackedLinear) and head_t is head_d


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_speculative_decoding_on_a_packed_target_is_lossless(arch):
    target = tiny_target(arch)
    prompt = torch.randint(0, 259, (12,))
    stock = generate(target, prompt, None, max_new_tokens=30).tokens
    drafter = build_drafter("layers:2", target)
    pack_for_decoding(target.model, drafter)
    alone = generate(target, prompt, None, max_new_tokens=30).tokens
    for k in (1, 3, 5):
        assert generate(target, prompt, drafter, k=k, max_new_tokens=30).tokens == alone
    assert alone == stock


@needs_int8
def test_int8_linear_is_close_to_the_float_layer_and_follows_weight_updates():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40).requires_grad_(False)
    q = Int8Linear(linear)
    x = torch.randn(3, 5, 64)
    exact = linear(x)
    got = q(x)
    assert got.shape == exact.shape and got.dtype == x.dtype
    # int8 weights (error <= scale/2 per entry) and bfloat16 activations: about 1% of the output's size
    assert (got - exact).norm() / exact.norm() < 0.02
    assert not torch.equal(got, exact)  # it really is the quantized path
    linear.weight.mul_(-2.0)
    assert (q(x) - linear(x)).norm() / linear(x).norm() < 0.02
    with pytest.raises(RuntimeError, match="drafting only"):
        Int8Linear(torch.nn.Linear(4, 4))(torch.randn(1, 4))
    assert "for CPU decoding" in int8_unavailable("cuda")  # eval refuses --draft-weights int8 there


@needs_int8
def test_int8_quantizes_draft_layers_and_never_the_target():
    target = tiny_target("llama")
    target.model.requires_grad_(False)
    view = build_drafter("layers:2", target)  # shares the target's layers: nothing to quantize
    head = _frozen(EagleHead(EagleConfig.for_target(target, "eagle3", draft_vocab_size=120)))
    eagle = EagleDrafter(head)
    n_head = sum(isinstance(m, torch.nn.Linear) for m in head.modules())
    assert quantize_draft_linears(target.model, view, eagle) == n_head > 0
    assert not any(isinstance(m, Int8Linear) for m in target.model.modules())
    keys = list(head.state_dict())
    assert pack_for_decoding(target.model, eagle) > 0  # packs the target, leaves the int8 layers alone
    assert all(isinstance(m, Int8Linear) for m in (head.lm_head, head.fuse_features))
    assert list(head.state_dict()) == keys
    assert unquantize_linears(head) == n_head


@needs_int8
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_with_an_int8_draft_is_lossless(arch):
    """A draft made of all the target's layers, quantized: it agrees with the target mostly but not
    always, so both the accept and the reject paths run, and the output must still be the target's."""
    target = tiny_target(arch)
    target.model.requires_grad_(False)
    draft = _frozen(from_target_layers(target, list(range(target.config.num_hidden_layers))))
    drafter = ModelDrafter(draft, "all-layers")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 259, (12,), generator=gen) for _ in range(3)]
    alone = [generate(target, p, None, max_new_tokens=40).tokens for p in prompts]
    assert quantize_draft_linears(target.model, drafter) > 0
    pack_for_decoding(target.model, drafter)
    accepted = []
    for p, reference in zip(prompts, alone):
        result = generate(target, p, drafter, k=4, max_new_tokens=40)
        assert result.tokens == reference
        accepted += result.accepted[:-1]
    assert sum(accepted) > 0 and any(a < 4 for a in accepted)  # both paths ran
