"""Piper's benchmarks: Piper against PyTorch baselines on the same model,
batch, microbatches, dtype and process count, plus compiler and runtime costs.

    python -m benchmarks                          # every suite, writes benchmarks/RESULTS.md
    python -m benchmarks --suite pipelines        # one suite (its command is printed with its results)
    python -m benchmarks --suite compiler overhead --quick --out /tmp/results.md
    python -m benchmarks --list

Each comparison alternates the two systems step by step (A B A B ...) and
reports the median steady-state step time (after warm-up) and the ratio.

`harness/` holds what the suites share (runner, timing, report, probes, workloads), `baselines/`
the PyTorch side (DDP, FSDP2, pipelining), `suites/` one file per suite. The files here are
tools run on their own: the `piper check` and prototype fuzzers (`fuzz_scripts`,
`fuzz_prototype`), `tune_accuracy`, `recovery`, `data_reading`, `lanes_or_in_turn`.
"""
