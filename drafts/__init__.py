"""Draft models and the Drafter protocol; importing this package registers every kind."""

from draftsmith.drafts import causal_lm, eagle, layer_subset, medusa, ngram  # noqa: F401  (registration)
from draftsmith.drafts.base import Drafter, Proposal, build_drafter, register, registered_kinds

__all__ = ["Drafter", "Proposal", "build_drafter", "register", "registered_kinds"]
