"""Prepacked oneDNN linears for CPU decoding (decode/cpu_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model, tiny_target

from draftsmith.decode.cpu_kernels import (
    PackedLinear,
    pack_for_decoding,
    pack_linears,
    packing_unavailable,
    unpack_linears,
)
from draftsmith.decode.speculative import generate
from draftsmith.drafts import build_drafter

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
