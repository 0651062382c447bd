"""What several test files share: one-device reference training, results against it, worker processes gone,
functions run in a real Gloo group of spawned processes."""
import datetime
import os
import socket
import time

import torch


def assert_same(result, tol=1e-9):
    """`(losses, ref_losses, state, ref_state)`: the losses and every parameter equal within `tol`."""
    losses, ref_losses, state, ref_state = result
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol)
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def train_one_device(model, optimizer, batches, keep_state_at: int):
    """Train `model` on one device: the losses, the state_dict after each step, and the optimizer
    state by parameter name after step `keep_state_at` (what a checkpoint then holds)."""
    names = {p: n for n, p in model.named_parameters()}
    losses, params, state = [], [], None
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if step + 1 == keep_state_at:
            state = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return losses, params, state


def gone(pid: int) -> bool:
    """True once no process has this pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_gone(pids, limit=30.0) -> list[int]:
    """Wait until every process in `pids` has exited; the pids still alive after `limit` seconds."""
    deadline = time.monotonic() + limit       # bounds the wait; not a claim about speed
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if not gone(p)]


def allocation_rise(fn) -> int:
    """The most bytes the CPU allocator held above where it began while `fn()` ran, counted as the
    benchmarks count a step's tensor peak (`benchmarks.harness.tp_probes.allocation_rise`)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.harness.tp_probes import allocation_rise as rise

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return rise(prof)


def on_gloo(fn, world: int) -> dict:
    """`fn(rank)` in each of `world` spawned processes joined in one Gloo group (no Ray): rank -> what
    it returned. `fn` lives at a module's top level and returns plain data (tensors passed between
    processes need their sender alive)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_gloo_rank, args=(fn, rank, world, port, out)) for rank in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs)
    return results


def _gloo_rank(fn, rank: int, world: int, port: int, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        out.put((rank, fn(rank)))
    finally:
        dist.destroy_process_group()


def raised(call, *args, **kwargs) -> BaseException | None:
    """What `call` raises, run in a thread: a hang guard only (a FIFO opened plainly blocks for ever);
    the test asserts the diagnostic."""
    import threading

    out = []

    def target():
        try:
            call(*args, **kwargs)
            out.append(None)
        except BaseException as exc:      # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} blocked on a special file"
    return out[0]
