"""Regions run under autograd in ways a plain backward does not: forward without keeping
activations and rerun in backward (`recompute`), and backward split into BI and BW
(`split_backward`). Both the executor's actions and the MoE pieces use them.

May import: `launch`, `communication`, `state`.
"""
