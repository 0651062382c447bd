"""The PyTorch baselines the suites measure Piper against: `torch_group` (a group of Ray actors,
one torch.distributed process each), `builds` (eager, DDP, FSDP2, torch.distributed.pipelining
and FSDP2 x pipelining on one rank), `composed` (the FSDP2 x pipelining parts, in torchtitan's
order) and `hf_own_ep` (transformers' own expert parallelism). Imports `harness/`, never `suites/`.
"""
