"""Jobs across the nodes of a Ray cluster (`ray.cluster_utils.Cluster` on one machine: a head
with no CPUs and two 2-CPU worker nodes, started once for the module): placement over both
nodes trains exactly like one device, a node removed mid-step is named, and `piper run
--max-restarts 1` finishes on a new node with the loss of an uninterrupted run."""
import os
import threading
import time

import pytest
import torch

import piper
from piper.testing import single_device
from tests.cluster_model import model as cluster_model
from tests.cluster_model import training_batches
from tests.test_train import assert_same_training, one_f_one_b, pipeline

ZERO3_1F1B = "mesh dp=2, pp=2\nuse one_f_one_b(microbatches=2) on pp\nuse zero3() on dp\n"


@pytest.fixture(scope="module")
def two_nodes():
    """A 3-node Ray cluster of our own. The session's local one (`ray_cluster`) is shut down
    first and comes back for the next test that asks for it: the two never overlap."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _batches(n, size=8):
    stream = training_batches(size)
    return [next(stream) for _ in range(n)]


def _pause_and_remove_node(cluster, marker: str, run):
    """Run `run()` in a thread; when the paused rank writes `marker`, remove its node, add a
    fresh one. Returns (what run returned or raised, the removed node's id)."""
    out = {}

    def target():
        try:
            out["value"] = run()
        except BaseException as exc:    # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while not os.path.exists(marker) and thread.is_alive():
        time.sleep(0.1)
    assert os.path.exists(marker), out
    time.sleep(1.5)              # the driver's status polls see the paused rank at its action
    node_id = open(marker).read().split()[0]
    victim = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    cluster.remove_node(victim)
    cluster.add_node(num_cpus=2)
    thread.join(180)             # bounds a hang; the test does not time anything
    assert not thread.is_alive(), "the run hung after its node was removed"
    return out, node_id


def test_zero3_1f1b_spread_over_two_nodes_trains_like_one_device(two_nodes):
    batches = _batches(3)
    strategy = pipeline(2, order=one_f_one_b, batch_axis="dp", zero=("optimizer", "grads", "params"))
    model = cluster_model()
    reference = single_device(cluster_model(), batches, lambda p: torch.optim.AdamW(p, lr=1e-3))
    with piper.compile(model, batches[0], strategy=strategy, mesh={"dp": 2, "pp": 2},
                       address=two_nodes.address, timeout=60) as job:
        where = job.placement()
        rendezvous = job.rendezvous
        losses = [job.step(*b) for b in batches]
        state = job.state_dict()
    nodes = [where[r]["node"] for r in range(4)]
    # Each pipeline (the innermost axis, pp) on one node, the two data-parallel replicas on two.
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
    assert {w["device"] for w in where.values()} == {"cpu"}
    assert rendezvous.rsplit(":", 1)[0] == where[0]["ip"] != "127.0.0.1"    # rank 0's node address
    ref_losses, ref_state = reference
    assert_same_training((losses, ref_losses, state, ref_state), rtol=1e-9, atol=1e-12)


def test_node_removed_mid_step_is_named(two_nodes, tmp_path, monkeypatch):
    batches = _batches(2)
    marker = str(tmp_path / "paused")
    # Rank 2 (dp=1, pp=0) pauses at its first forward of the second step; its node is removed then.
    strategy = pipeline(2, batch_axis="dp")
    job = piper.compile(cluster_model(), batches[0], strategy=strategy, mesh={"dp": 2, "pp": 2},
                        address=two_nodes.address, timeout=60,
                        worker_env={"PIPER_FAULT": f"rank=2 action=0F0 do=pause delay=120 step=1 once={marker}"})
    where = job.placement()
    job.step(*batches[0])
    out, node = _pause_and_remove_node(two_nodes, marker, lambda: job.step(*batches[1]))
    err = out.get("error")
    assert isinstance(err, piper.PiperError) and err.code == "worker-died", out
    message = str(err)
    assert node == where[2]["node"]
    assert f"rank 2 (dp=1, pp=0) on node {node[:8]}" in message and f"pid {where[2]['pid']}" in message
    assert "while running 0F0" in message and "rank 3 (dp=1, pp=1)" in message
    assert f"every worker on node {node[:8]} died at once" in message
    job.close()


def test_piper_run_recovers_on_a_new_node_from_its_checkpoint_with_the_same_loss(two_nodes, tmp_path, monkeypatch, capsys):
    from piper.cli import main

    steps = 3
    script = tmp_path / "zero3_1f1b.pps"
    script.write_text(ZERO3_1F1B)
    marker = str(tmp_path / "paused")
    monkeypatch.setenv("PIPER_FAULT", f"rank=2 action=0F0 do=pause delay=120 step=1 once={marker}")
    model_file = os.path.join(os.path.dirname(__file__), "cluster_model.py")
    args = ["run", str(script), "--model", f"{model_file}:model", "--steps", str(steps),
            "--address", two_nodes.address, "--max-restarts", "1",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    out, removed = _pause_and_remove_node(two_nodes, marker, lambda: main(args))
    assert out.get("value") == 0, out
    text = " ".join(capsys.readouterr().err.split())     # rich wraps long lines
    assert "restart worker-died" in text and "rank 2 (dp=1, pp=0)" in text
    assert "from the checkpoint of step 1 (failed at step 2)" in text      # saved after the first step, reloaded
    # The restarted job runs on the surviving node and the new one, not the removed one.
    restarted_on = text.split("on node(s) ")[1].split()[0:2]
    assert removed[:8] not in " ".join(restarted_on)
    final = float(text.split("final loss ")[1].split()[0])
    ref_losses, _ = single_device(cluster_model(), _batches(steps, 16), lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert final == pytest.approx(ref_losses[-1], rel=1e-9, abs=1e-12)
