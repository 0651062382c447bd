"""Lost and stalled workers are named (rank, mesh position, node, pid, action), nothing
hangs, and nothing outlives the job; placement plans; the rendezvous address."""
import os

import pytest

import piper
from piper.runtime.launch.placement import describe_rank, interface_of, plan_placement
from piper.runtime.health.faults import Fault
from tests.helpers import wait_gone
from tests.test_train import gpt, gpt_batches, pipeline


def test_fault_spec_reads_every_field_and_refuses_typos():
    f = Fault.parse("rank=2, action=0F1 do=kill step=1 delay=0.5 once=/tmp/x")
    assert f == Fault(2, "kill", "0F1", 1, 0.5, "/tmp/x")
    for bad in ("do=kill", "rank=1 do=explode", "rank=1 do=kill acton=0F1"):
        with pytest.raises(ValueError, match="PIPER_FAULT"):
            Fault.parse(bad)


def test_placement_keeps_the_innermost_axis_inside_a_node():
    # dp=2 x pp=2 on two 2-core nodes: each pipeline on its own node.
    p = plan_placement((("dp", 2), ("pp", 2)), [2, 2], "cpu")
    assert p.strategy == "STRICT_SPREAD" and p.bundle_of == (0, 0, 1, 1)
    assert p.bundles == ({"CPU": 2.0}, {"CPU": 2.0}) and p.claim == 1.0
    # Everything fits on one node, or there is only one: one bundle per rank, packed.
    assert plan_placement((("dp", 2), ("pp", 2)), [8, 2], "cpu").strategy == "PACK"
    assert plan_placement((("dp", 2), ("pp", 2)), [2], "cpu").bundle_of == (0, 1, 2, 3)
    # An axis longer than a node: neighbours along it still share nodes, in pairs.
    p = plan_placement((("dp", 2), ("pp", 4)), [2, 2], "cpu")
    assert p.strategy == "SPREAD" and p.bundle_of == (0, 0, 1, 1, 2, 2, 3, 3) and p.claim == 0.5
    # GPUs: a tensor-parallel group of 4 per 4-GPU node.
    p = plan_placement((("dp", 2), ("tp", 4)), [4, 4, 4], "cuda")
    assert p.strategy == "STRICT_SPREAD" and p.bundles[0]["GPU"] == 4.0 and p.resources("cuda")["num_gpus"] == 1.0


def test_a_rank_is_described_by_mesh_position_node_and_pid():
    text = describe_rank(2, {"dp": 1, "pp": 0}, {"node": "3f2a9c1e77", "ip": "10.0.0.5", "pid": 4242})
    assert text == "rank 2 (dp=1, pp=0) on node 3f2a9c1e (10.0.0.5), pid 4242"


@pytest.mark.skipif(not os.path.isdir("/sys/class/net/lo"), reason="needs Linux with a loopback named lo")
def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None          # an address this machine does not hold


@pytest.mark.usefixtures("ray_cluster")
def test_sigkilled_worker_is_named_not_its_peers():
    import ray

    batch = gpt_batches(1)[0]
    # Rank 2 (dp=1, pp=0) kills itself in its second step, at its second forward.
    fault = "rank=2 action=0F1 do=kill step=1 delay=1.5"
    job = piper.compile(gpt(2), batch, strategy=pipeline(2, batch_axis="dp"), mesh={"dp": 2, "pp": 2},
                        timeout=20, worker_env={"PIPER_FAULT": fault})
    where = job.placement()
    assert sorted(where) == [0, 1, 2, 3] and where[2]["coords"] == {"dp": 1, "pp": 0}
    # The rendezvous is at rank 0's node address as Ray knows it, not a loopback guess.
    node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}[where[0]["node"]]
    assert job.rendezvous.rsplit(":", 1)[0] == node_ip == where[0]["ip"]
    # Gloo binds to that address's interface, not to what the host name resolves to (often 127.0.0.1).
    assert all(w["interface"] == interface_of(w["ip"]) for w in where.values())
    job.step(*batch)
    with pytest.raises(piper.PiperError) as err:
        job.step(*batch)
    assert err.value.code == "worker-died"
    message = str(err.value)
    assert f"rank 2 (dp=1, pp=0) on node {where[2]['node'][:8]}" in message
    assert f"pid {where[2]['pid']}" in message and "while running 0F1" in message
    assert "rank 0 at" in message       # where the others were
    assert not wait_gone(job.pids), "a worker process outlived its job"


@pytest.mark.usefixtures("ray_cluster")
def test_stopped_worker_is_named_at_the_timeout():
    batch = gpt_batches(1)[0]
    # The step waits out the whole timeout (a stopped worker never answers): keep it short.
    job = piper.compile(gpt(2), batch, strategy=pipeline(2), mesh={"pp": 2}, timeout=5,
                        worker_env={"PIPER_FAULT": "rank=1 action=1F1 do=stop delay=1"})
    pid = job.placement()[1]["pid"]
    with pytest.raises(piper.PiperError) as err:
        job.step(*batch)
    assert err.value.code == "worker-timeout"
    message = str(err.value)
    assert f"rank 1 (pp=1) on node {job.placement()[1]['node'][:8]}" in message and f"pid {pid}" in message
    assert "does not answer" in message and "last seen while running 1F1" in message
    assert "its process is stopped" in message           # the driver's node: /proc tells
    assert "rank 0 at" in message
    assert not wait_gone(job.pids), "a stopped worker outlived its job"


@pytest.mark.usefixtures("ray_cluster")
def test_a_worker_that_raises_is_blamed_not_the_peer_left_waiting():
    batch = gpt_batches(1)[0]
    with piper.compile(gpt(2), batch, strategy=pipeline(2), mesh={"pp": 2}, timeout=20,
                       worker_env={"PIPER_FAULT": "rank=0 action=0F1 do=raise delay=1"}) as job:
        with pytest.raises(piper.PiperError) as err:
            job.step(*batch)
    assert err.value.code == "worker-failed"
    message = str(err.value)
    assert "rank 0 (pp=0) on node" in message and "while running 0F1" in message
    assert "RuntimeError: injected fault at 0F1" in message

