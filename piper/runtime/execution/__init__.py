"""The executor: one device's plan run action by action (`executor`, a class of mixins): one step
and what it holds (`step_loop`, `step_state`), the compute actions (`forward_actions`,
`backward_actions`, with `gradient_routing`), overlapped slots (`lanes`), evaluation, memory
accounting, and the runtime's own time outside its computes (`overheads`).

May import: `launch`, `communication`, `state`, `autograd`, `moe`.
"""
