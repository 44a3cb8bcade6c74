"""Per-kind training objectives; each module registers its kinds with ``train.config.register_objective``."""
