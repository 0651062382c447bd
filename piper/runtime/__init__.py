"""The strategy-agnostic runtime: Ray actors executing per-device plans.

Its rooms, lowest first; a room imports only the rooms above it in this list (and the layers
below the runtime: base, front ends, IR, compiler):

    launch/         what starts a job's workers: where they go, what they are handed, the pool
    communication/  torch.distributed groups and collectives, SEND/RECV, tied weights' transfers
    state/          what a worker keeps between steps: units, flat buffers, optimizers, precision,
                    clipping, checkpoints
    autograd/       regions run under autograd beyond a plain backward: recompute, BI/BW split
    moe/            expert groups and regions cut at their all-to-alls, run piece by piece
    execution/      the executor: one device's plan, action by action
    health/         the driver's watch over its workers, and the faults tests inject
    workers/        the Ray actor that owns a device, and what the driver asks of it
"""
