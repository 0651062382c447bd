"""What one TP=2 step saves for its backward, torch's own tensor parallelism against Piper's:
suite 16's model and batch (examples/llama_tp.py, full size), one process.

    .venv/bin/python -m benchmarks.tp_saved_bytes            # TP + vocab, then TP + SP + vocab

torch: `parallelize_module` with suite 16's plan (torchtitan's) over a fake process group of 2
(its collectives move nothing; every shape is a rank's), forward under `loss_parallel()` inside a
`saved_tensors_hooks` that counts each saved storage once (a DTensor's local one), parameters
left out. Piper: the memory model's count of the captured program's region graphs on TP's
stand-in group, run whole and cut into pieces at the TP collectives as the runtime runs them
(`piper.compiler.memory_model.region_bytes`; exact against the runtime in tests/test_memory_model.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from examples import llama_tp

from .baselines.tensor_parallel import plan as torch_plan
from .suites.tensor_parallel import plan_text, workload


def torch_saved(sequence: bool, sizes: dict, batch) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = llama_tp.make_model(torch.float32, **sizes, stages=1)
        model = parallelize_module(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                                   torch_plan(model, sequence=sequence))
        local = [p._local_tensor if isinstance(p, DTensor) else p for p in model.parameters()]
        seen, total = {p.untyped_storage()._cdata for p in local}, [0]

        def pack(t):
            storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                total[0] += storage.nbytes()
            return t
        ids, targets = batch
        with loss_parallel(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = model.embed(ids)
            for block in model.blocks:
                x = block(x)
            logits = model.head(model.norm(x))
            torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return total[0]
    finally:
        dist.destroy_process_group()


def piper_saved(sequence: bool, sizes: dict, batch) -> tuple[int, int]:
    from piper.compiler.memory_model import region_bytes
    from piper.dsl import load_strategy
    from piper.frontend.capture import capture
    from piper.frontend.tensor_parallel import plan_of

    mesh, directives = load_strategy(plan_text({"tp": 2}, sequence=sequence)).build(None)
    program = capture(llama_tp.make_model(torch.float32, **sizes, stages=1), batch, tensor=plan_of(directives, mesh))
    whole = region_bytes(program)
    cut = region_bytes(program, pieces={r.index: (False, True) for r in program.regions})
    return sum(b.saved for b in whole.values()), sum(b.saved for b in cut.values())


def main(quick: bool = False) -> None:
    sizes, batch, seq = workload(quick)
    data = llama_tp.batches(1, batch=batch, seq=seq, vocab=sizes["vocab"])[0]
    print("| plan | torch saved MiB | Piper saved MiB (graphs whole) | Piper saved MiB (cut into pieces) |")
    print("|---|---|---|---|")
    for label, sequence in (("TP + vocab", False), ("TP + SP + vocab", True)):
        whole, cut = piper_saved(sequence, sizes, data)
        print(f"| {label} | {torch_saved(sequence, sizes, data) / 2**20:.2f} | {whole / 2**20:.2f} | {cut / 2**20:.2f} |")


if __name__ == "__main__":
    main()
