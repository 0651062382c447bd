"""Communication on a worker: torch.distributed set-up, groups and collectives (`collectives`),
the executor's SEND/RECV and collective actions (`comm_actions`), and tied weights' transfers
(`tied_weights`).

May import: `launch` (the specs its actions read).
"""
