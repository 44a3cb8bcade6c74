"""What a training run stands on, apart from what it trains: the distributed set-up and strategies
(``distributed.py``), a target sharded over processes (``shard_target.py``), checkpoints and exact resume
(``checkpoint.py``, ``resume.py``), what a cluster throws at a run (``faults.py``), the checks before anything
loads (``preflight.py``), where metrics go (``loggers.py``) and the one-line progress of long stages
(``progress.py``). The loop (``train/loop.py``) and the objectives use it; it knows neither."""
