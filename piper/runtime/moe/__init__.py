"""Mixture of experts on a worker: the expert groups the MoE ops move tokens over
(`expert_groups`), and regions cut at their all-to-alls run piece by piece (`pieces`, with
`piece_forward`, `piece_backward`, `piece_split_backward`, `piece_exchanges`, and one
microbatch's pass through the pieces, `cut_pass`).

May import: `launch`, `communication`, `state`, `autograd`.
"""
