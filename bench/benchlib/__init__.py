"""What the bench scripts share and the product never calls: timed side-by-side runs (``timed``), training
step timing and FLOPs (``train_speed``), the peers' training inputs (``peer_inputs``), llama-server's own
acceptance from its trace (``llamacpp_runs``), a head's round trip through a device call's small files
(``transport``) and a result's provenance and JSON (``records``).

Scripts in ``bench/`` import it as ``benchlib`` (their folder is on ``sys.path``); the tests put ``bench/`` on
the path in ``tests/conftest.py``.
"""
