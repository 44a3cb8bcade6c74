"""The stages of bench/peer_training.py (the peers and draftsmith trained side by side), one module each.

``common``: paths, constants, the bench lock, timed runs, run names and seeds; ``data``: the data and capture
stages; ``training``: the train and judge stages and the rates of a run; ``evaluation``: the eval and llamacpp
stages; ``report``: the table. bench/peer_training.py is the command line; bench/peer_sweep.py and
bench/step_like_for_like.py import what they run from here.
"""
