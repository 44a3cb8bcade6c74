"""The recipes shipped with draftsmith, as package data: ``draftsmith train NAME`` finds ``NAME.yaml`` here."""
