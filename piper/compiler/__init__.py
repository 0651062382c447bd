"""The compiler: the lowered DAG scheduled and projected into one plan per device (`plans.py`),
verified by simulation, priced, and searched (`piper tune`)."""
