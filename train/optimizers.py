"""The optimizer a training run takes (``optim.name``): AdamW, or Muon on the draft's hidden weight matrices with
AdamW on the rest (speculators' default), the pair as one torch optimizer so that Lightning's loop, gradient
clipping, learning-rate schedule and checkpoints treat it as they treat AdamW."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over ``muon`` and torch.optim.AdamW over ``adamw`` (param groups), stepped together.

    Its ``param_groups`` are the two optimizers' own group dicts, so a learning-rate scheduler scales both from
    their own peak (Muon's ``muon_lr``, AdamW's ``lr``) and clipping sees every gradient; its state dict holds
    both optimizers' states, so a run resumes either one exactly."""

    def __init__(self, muon: list[nn.Parameter], adamw: list[dict], o: OptimConfig):
        self.muon = torch.optim.Muon(
            muon, lr=o.muon_lr or o.lr, weight_decay=o.muon_weight_decay, momentum=o.muon_momentum,
            adjust_lr_fn="match_rms_adamw",
        )  # fmt: skip
        self.adamw = torch.optim.AdamW(adamw, lr=o.lr, betas=o.betas) if adamw else None
        self.parts = [part for part in (self.muon, self.adamw) if part is not None]
        super().__init__([p for part in self.parts for g in part.param_groups for p in g["params"]], {})
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
