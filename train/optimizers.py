"""The optimizer a training run takes (``optim.name``): AdamW, or Muon on the draft's hidden weight matrices with
AdamW on the rest (speculators' default), the pair as one torch optimizer so that Lightning's loop, gradient
clipping, learning-rate schedule and checkpoints treat it as they treat AdamW.

torch's Muon orthogonalises each update in bfloat16. A CPU with no bf16 matrix instructions (no AVX512-BF16,
no AMX; ``loading.bf16_is_fast``) runs those products through a slow fallback (BENCHMARKS.md, training throughput:
``bench/muon_orthogonalise.py``). There the same iteration runs its products in float32 and rounds each result
to bf16 (``newton_schulz_bf16``), as a bf16 matrix unit accumulates in float32 and rounds once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.optim._muon as torch_muon
from torch import nn

from draftsmith.loading import bf16_is_fast
from draftsmith.train.schema import OptimConfig

MUON_EXCLUDED = ("embed", "lm_head", "wte", "word_embeddings")
"""Name parts of 2-D weights that stay with AdamW under Muon: embeddings and vocabulary read-outs, whose rows
are tokens, not a linear map to orthogonalise (Keller Jordan's Muon, and speculators' split)."""


def muon_split(model: nn.Module, trainable: list[tuple[str, nn.Parameter]]) -> tuple[list, list]:
    """(Muon's, AdamW's) parameters of ``trainable``: Muon takes a 2-D matrix with both sides > 1 that is not an
    embedding (any ``nn.Embedding``, the model's output embeddings) or named like one (``MUON_EXCLUDED``)."""
    vocab = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if output is not None and getattr(output, "weight", None) is not None:
        vocab.add(id(output.weight))
    muon, rest = [], []
    for name, p in trainable:
        matrix = p.ndim == 2 and min(p.shape) > 1
        excluded = id(p) in vocab or any(part in name for part in MUON_EXCLUDED)
        (muon if matrix and not excluded else rest).append(p)
    return muon, rest


def adamw_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on the matrices only, not on biases and norms."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def newton_schulz_bf16(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch's Muon orthogonalisation (``torch.optim._muon._zeropower_via_newtonschulz``: the quintic
    Newton-Schulz iteration on bf16 operands, bf16 results) with each product run in float32 and rounded to bf16,
    as a bf16 matrix unit does: the same iteration at float32's speed on a CPU without one."""
    a, b, c = ns_coefficients

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    x = bf16(grad)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = bf16(x / x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = bf16(x @ x.T)
        update = bf16(torch.addmm(gram, gram, gram, beta=b, alpha=c))
        x = bf16(torch.addmm(x, update, x, beta=a))
    return (x.T if tall else x).bfloat16()


def bf16_matmul_is_slow(params: list[nn.Parameter]) -> bool:
    """Whether torch's bf16 products over ``params`` are slower than float32 ones: on a device where
    ``bf16_is_fast`` says no (the rule ``auto`` precision follows), such as a CPU without bf16 matrix
    instructions."""
    return not all(bf16_is_fast(p.device) for p in params)


@contextlib.contextmanager
def orthogonalised_by(function: Callable) -> Iterator[None]:
    """torch's Muon orthogonalising with ``function`` for a block (the step), restored after."""
    own = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = function
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = own


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over ``muon`` and torch.optim.AdamW over ``adamw`` (param groups), stepped together.

    Its ``param_groups`` are the two optimizers' own group dicts, so a learning-rate scheduler scales both from
    their own peak (Muon's ``muon_lr``, AdamW's ``lr``) and clipping sees every gradient; its state dict holds
    both optimizers' states, so a run resumes either one exactly. Where the CPU has no bf16 matrix
    instructions, Muon's orthogonalisation is ``newton_schulz_bf16``'s (see the module docstring)."""

    def __init__(self, muon: list[nn.Parameter], adamw: list[dict], o: OptimConfig):
        self.muon = torch.optim.Muon(
            muon, lr=o.muon_lr or o.lr, weight_decay=o.muon_weight_decay, momentum=o.muon_momentum,
            adjust_lr_fn="match_rms_adamw",
        )  # fmt: skip
        self.adamw = torch.optim.AdamW(adamw, lr=o.lr, betas=o.betas) if adamw else None
        self.parts = [part for part in (self.muon, self.adamw) if part is not None]
        slow = bf16_matmul_is_slow(muon) and hasattr(torch_muon, "_zeropower_via_newtonschulz")
        self.orthogonalise = newton_schulz_bf16 if slow else None
        super().__init__([p for part in self.parts for g in part.param_groups for p in g["params"]], {})
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with orthogonalised_by(self.orthogonalise) if self.orthogonalise else contextlib.nullcontext():
            for part in self.parts:
                part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                "this checkpoint's optimizer state is not Muon's and AdamW's (optim.name muon): it was written "
                "by a run with another optim.name; resume with that optim.name, or start a new run"
            )
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = [g for part in self.parts for g in part.param_groups]


def build_optimizer(model: nn.Module, trainable: list[tuple[str, nn.Parameter]], o: OptimConfig):
    """The optimizer ``o.name`` asks for over ``trainable`` (name, parameter) pairs of ``model``."""
    if o.name == "adamw":
        return torch.optim.AdamW(
            adamw_groups([p for _, p in trainable], o.weight_decay), lr=o.lr, betas=o.betas
        )
    muon, rest = muon_split(model, trainable)
    if not muon:
        raise ValueError(
            "optim.name muon: the draft has no hidden weight matrix for Muon (only embeddings, read-outs, norms "
            "or biases are trained); set optim.name adamw"
        )
    return MuonAdamW(muon, adamw_groups(rest, o.weight_decay), o)
