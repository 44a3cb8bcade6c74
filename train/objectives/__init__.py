"""Objectives of the draft kinds trained as ``Class(target, token_counts=..., **draft.options)``.

``draftsmith.train.config.build_objective`` reads this table (``draft.kind`` -> ``"module:Class"``)
and imports a module only when its kind is built; other kinds register a factory there instead.
"""

OBJECTIVES: dict[str, str] = {
    "eagle1": "draftsmith.train.objectives.eagle:Eagle1Objective",
    "eagle3": "draftsmith.train.objectives.eagle:Eagle3Objective",
}
