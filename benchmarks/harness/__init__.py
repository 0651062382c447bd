"""The benchmark harness: what every suite shares.

`runner` (the `python -m benchmarks` command line and the suite list), `report` (rich tables and
the markdown report), `results` (a suite's tables and metrics as data), `timing` (the A/B
alternation, torch-vs-Piper rows), `machine` (the Ray cluster, the machine's description),
`probes` (measurements inside workers), `measured_steps` (one job's steps measured and predicted),
`divided_experts`, and the models: `workloads` (the example GPT, a Hugging Face Llama, linear chains
and the strategies they run under), `families`/`families_more` (suite 9's model families),
`llama_stage`. Apart from the runner, which loads a suite by its name, nothing here imports
`baselines/` or `suites/`.
"""
