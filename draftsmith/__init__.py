"""draftsmith: train, evaluate and publish speculative-decoding drafts."""

__version__ = "0.1.0"
