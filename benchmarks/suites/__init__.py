"""The benchmark suites, one per file, named for the suite (`--suite batch-composition` runs
`batch_composition.py`); each has `run(ctx) -> SuiteResult` and a docstring saying what it
measures. Suites import `harness/`, `baselines/` and the tools beside them (suite 12 runs
`tune_accuracy`), never each other; the suite list is
`harness/runner.py`'s `SUITES`.
"""
