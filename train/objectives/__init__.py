"""Per-kind training objectives. Each module registers the kinds it trains with
``train.registry.register_objective``; ``drafts/base.py``'s ``KINDS`` says which module trains a kind."""
