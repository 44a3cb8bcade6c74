"""Per-kind training objectives. Each module registers the kinds it trains with
``train.registry.register_objective``; ``train.registry.OBJECTIVE_MODULES`` says which module trains a kind."""
