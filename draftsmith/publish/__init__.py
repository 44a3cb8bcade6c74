"""A draft as a self-contained Hugging Face Hub folder with a model card of measured numbers (``cli.py``:
build and push; ``card.py``: the card)."""
