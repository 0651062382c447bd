"""Two standard strategies as `@piper.strategy` Python functions: 1F1B and ZeRO-3.

They build exactly the IR of stdlib/one_f_one_b.pps and stdlib/zero3.pps
(tests/test_stdlib.py checks it), so a strategy can start in either form and
move to the other. Compose them as the script examples/gpt_zero3_1f1b.pps does:

    import piper
    from examples.strategies import one_f_one_b, zero3

    @piper.strategy
    def gpt_zero3_1f1b(s):
        s.use(one_f_one_b, microbatches=8, axis="pp")
        s.use(zero3, axis="dp")

    job = piper.compile(model, batch, strategy=gpt_zero3_1f1b, mesh={"dp": 2, "pp": 2})
"""
import piper


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[str]:
    """The 1F1B slots of one stage: warm-up forwards, steady F/B pairs, the backwards still owed.

    >>> one_f_one_b_order(0, 2, 3)
    ['F(MB=0)', 'F(MB=1)', 'B(MB=0)', 'F(MB=2)', 'B(MB=1)', 'B(MB=2)']
    """
    warm = min(stages - stage - 1, microbatches)   # device `stage` holds at most p - stage microbatches
    slots = [f"F(MB={m})" for m in range(warm)]
    for m in range(microbatches - warm):
        slots += [f"F(MB={m + warm})", f"B(MB={m})"]
    slots += [f"B(MB={m})" for m in range(microbatches - warm, microbatches)]
    return slots


@piper.strategy
def one_f_one_b(s, microbatches, axis="pp"):
    """1F1B (PipeDream-Flush): region PP=stage on device `stage` of `axis`; warm-up
    forwards, then one forward and one backward, then the backwards still owed."""
    p = s.size(axis)
    s.split("MB", microbatches)
    for stage in range(p):
        s.place(f"PP={stage}", s.mesh[axis][stage])
    for stage in range(p):
        s.order(f"PP={stage}", one_f_one_b_order(stage, p, microbatches))


@piper.strategy
def zero3(s, axis="dp"):
    """ZeRO-3: data parallel over `axis` with optimizer state, gradients and parameters sharded."""
    s.shard("batch", over=axis)
    s.shard("optimizer", "grads", "params", over=axis)
