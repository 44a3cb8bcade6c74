"""Faster linear layers for decoding on a CPU: weights prepacked once for oneDNN.

At batch 1 a decode step multiplies a handful of rows (1 for plain decoding, k + 1 for a verify
pass) by every weight matrix. PyTorch's default CPU path (MKL sgemm on the dense weight) is poor at
that shape: a 2-row product can take twice as long as a 1-row one, where reading the weight — the
real cost at this size — is the same. oneDNN with the weight reordered once into its blocked layout
(what ``torch.compile``'s CPU backend does when it freezes weights) reads it at close to memory speed
for any small row count (docs/studies/decoder_speed.md, "CPU kernels").

Drafts can go further (``quantize_draft_linears``): weight-only int8 with one scale per output
channel, run by ``torch.ops.aten._weight_int8pack_mm`` on bfloat16 activations. A draft's precision
never changes the output — the target verifies every drafted token, and under sampling the drafter's
own (quantized) distribution is what the acceptance rule uses — it can only change how many drafted
tokens the target accepts; for a weight-bound head it roughly halves the drafting time
(docs/studies/eagle3_cpu_stages.md).
The target is never quantized: its layers (also those a ``layers:N`` draft shares with it) are skipped.

``pack_linears(model)`` swaps every frozen ``nn.Linear`` for a ``PackedLinear`` that keeps the
original weight (shared, so state dicts, tied embeddings and hooks see the same tensor) plus the
packed copy. Whether a packed layer runs oneDNN or PyTorch's stock kernel is its ``KernelPolicy``'s
call, per row count (one row: plain decoding and drafting; more: a verify pass or a prompt), so the
choice can follow what measures faster on the machine (``decode/kernel_choice.py``): packing wins on
the CPU it was written on and loses to stock on one with AMX matrix units (docs/studies/decoder_speed.md, "CPU kernels"). It is for inference only: a packed layer refuses to run when autograd would need its
weight's gradient, since the packed copy would not follow an update. ``unpack_linears`` undoes it.
Packing is skipped (and says why) where it does not apply: not a CPU tensor, not float32, or a
PyTorch without the oneDNN op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

KERNELS = ("packed", "stock")
"""The float32 CPU kernels a ``PackedLinear`` can run: oneDNN on the prepacked weight, or PyTorch's own."""


@dataclass
class KernelPolicy:
    """Which kernel the packed layers sharing this policy run, by the rows of the product.

    ``plain``: one row (a plain decoding step, a drafter's one-token step); ``verify``: more rows (a verify
    pass of k + 1 tokens, a prompt). Each is one of ``KERNELS``.
    """

    plain: str = "packed"
    verify: str = "packed"

    def __post_init__(self) -> None:
        for name, kernel in (("plain", self.plain), ("verify", self.verify)):
            if kernel not in KERNELS:
                raise ValueError(f"KernelPolicy.{name} = {kernel!r}; choose one of {', '.join(KERNELS)}")

    def packed_for(self, rows: int) -> bool:
        return (self.plain if rows == 1 else self.verify) == "packed"

    @contextmanager
    def forced(self, kernel: str) -> Iterator[None]:
        """Every product on ``kernel`` while the block runs (a measurement, or transformers' own generate)."""
        kept = (self.plain, self.verify)
        self.plain = self.verify = kernel
        self.__post_init__()
        try:
            yield
        finally:
            self.plain, self.verify = kept


def packing_unavailable(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why weights on (device, dtype) cannot be packed here; None when they can."""
    if torch.device(device).type != "cpu":
        return f"device is {device}, packing is for CPU decoding"
    if dtype != torch.float32:
        return f"dtype is {dtype}, packing is used for float32 only"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return "this PyTorch build lacks torch.ops.mkldnn._linear_pointwise"
    return None


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose forward runs oneDNN on a weight copy reordered once (inference only)."""

    def __init__(self, linear: nn.Linear, policy: KernelPolicy | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.policy = KernelPolicy() if policy is None else policy
        self.weight = linear.weight  # the same Parameter: tying and state_dict keys are unchanged
        self.bias = linear.bias
        # not a buffer: the blocked layout is private to oneDNN and must not reach a state dict
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self._version = linear.weight._version
        self.__dict__["_original"] = linear  # kept for unpack_linears, not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "a PackedLinear is for inference only (its packed weight copy would not follow training); "
                "call draftsmith.decode.cpu_kernels.unpack_linears(model) before training"
            )
        if self.weight._version != self._version:  # the weight was changed in place since packing
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self._version = self.weight._version
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or not self.policy.packed_for(x.numel() // self.in_features)
        ):
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


@contextmanager
def stock_kernels(model: nn.Module) -> Iterator[None]:
    """Every packed layer of ``model`` on PyTorch's stock kernel while the block runs: the model as a user
    would run it without draftsmith (``evaluate``'s transformers ``generate`` baseline)."""
    policies = {id(m.policy): m.policy for m in model.modules() if isinstance(m, PackedLinear)}
    with ExitStack() as stack:
        for policy in policies.values():
            stack.enter_context(policy.forced("stock"))
        yield


def int8_unavailable(device: torch.device | str) -> str | None:
    """Why int8 weight-only draft layers cannot run on ``device`` here; None when they can."""
    if torch.device(device).type != "cpu":
        return f"device is {device}, int8 draft weights are for CPU decoding"
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return "this PyTorch build lacks torch.ops.aten._weight_int8pack_mm"
    return None


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights (symmetric, one scale per output row), for drafting only.

    y = (x in bfloat16) @ (W_int8 * scale).T + bias, computed in bfloat16 and returned in x's dtype.
    The float weight stays the module's parameter (state dicts are unchanged); the int8 copy follows
    in-place changes to it.
    """

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._quantize()
        self.__dict__["_original"] = linear  # kept for unquantize_linears, not a submodule

    @torch.no_grad()
    def _quantize(self) -> None:
        w = self.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self._int8 = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self._scale = scale.to(torch.bfloat16)
        self._version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "an Int8Linear is for drafting only (its int8 copy would not follow training); "
                "call draftsmith.decode.cpu_kernels.unquantize_linears(model) before training"
            )
        if self.weight._version != self._version:
            self._quantize()
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(rows, self._int8, self._scale)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def quantize_draft_linears(target: nn.Module, *drafters) -> int:
    """Swap the draft-only frozen CPU linears of each drafter for ``Int8Linear``; how many were swapped.

    ``target``: the target's model; its linear layers are never quantized, also where a drafter holds
    them (a ``layers:N`` view). Run before ``pack_for_decoding`` (which then leaves these layers alone).
    """
    keep = {id(m) for m in target.modules()}
    count = 0
    for drafter in drafters:
        modules = drafter_modules(drafter)
        for module in modules:
            for parent in list(module.modules()):
                for name, child in list(parent.named_children()):
                    if not isinstance(child, (nn.Linear, PackedLinear)) or id(child) in keep:
                        continue
                    if child.weight.requires_grad or int8_unavailable(child.weight.device) is not None:
                        continue
                    setattr(parent, name, Int8Linear(child))
                    count += 1
    return count


def unquantize_linears(model: nn.Module) -> int:
    """Put back the layer each ``Int8Linear`` in ``model`` replaced; how many were restored."""
    return _restore(model, Int8Linear)


def _restore(model: nn.Module, kind: type) -> int:
    """Swap every ``kind`` layer in ``model`` back for the layer it was made from."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kind):
                setattr(parent, name, child._original)
                count += 1
    return count


def drafter_modules(obj) -> list[nn.Module]:
    """The modules an object holds: itself if a module, else its module attributes (a drafter's models)."""
    if isinstance(obj, nn.Module):
        return [obj]
    return [v for v in vars(obj).values() if isinstance(v, nn.Module)]


def pack_linears(
    model: nn.Module, packed: dict[int, PackedLinear] | None = None, policy: KernelPolicy | None = None
) -> int:
    """Swap every frozen float32 CPU ``nn.Linear`` in ``model`` for a ``PackedLinear``; how many were swapped.

    Layers whose weight requires grad are left alone (they may be trained). Idempotent. ``packed``
    maps id(original Linear) to its packed layer, so a Linear shared by several models (a
    ``layers:N`` view shares the target's) is packed once. ``policy``: shared by every layer packed
    here (default: a new one that packs every product).
    """
    policy = KernelPolicy() if policy is None else policy
    packed = {} if packed is None else packed
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.requires_grad:
                continue
            if packing_unavailable(child.weight.device, child.weight.dtype) is not None:
                continue
            if id(child) not in packed:
                packed[id(child)] = PackedLinear(child, policy)
            setattr(parent, name, packed[id(child)])
            count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Put back the original ``nn.Linear`` of every ``PackedLinear`` in ``model``; how many were restored."""
    return _restore(model, PackedLinear)


def pack_for_decoding(*objects, policy: KernelPolicy | None = None) -> int:
    """Pack the frozen linears of each model, and of every module a drafter holds; total swapped.

    Accepts ``nn.Module``s, objects with a ``model`` attribute (the target) and drafters (their
    module attributes are packed). Modules reached twice are packed once. ``policy``: which kernel the
    packed layers run, by row count (default: packed for all; ``decode/kernel_choice.py`` measures one).
    """
    seen: set[int] = set()
    packed: dict[int, PackedLinear] = {}
    total = 0
    for obj in objects:
        for module in drafter_modules(obj):
            if id(module) not in seen:
                seen.add(id(module))
                total += pack_linears(module, packed, policy)
    return total
