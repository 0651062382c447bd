"""The IR (one global training DAG, `dag.py`) and the passes that rewrite it: the statements,
recompute, lowering to communication, tied weights and expert parallelism."""
