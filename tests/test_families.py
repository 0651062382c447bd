"""The benchmark model families (benchmarks/harness/families.py): torch's stage modules compute what
Piper captures, and the region-vs-eager probe runs the captured graph to the same loss.
No timing assertions."""
import math

import pytest
import torch

from benchmarks.harness.families import FAMILIES
from benchmarks.harness.runner import BY_NAME
from benchmarks.suites.families import region_vs_eager


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("regions", [2, 4])
def test_stages_chain_to_the_models_loss_and_split_its_parameters(name, regions):
    family = FAMILIES[name]
    model = family.make(family.quick, regions=regions)
    x, y = family.batches(family.quick, 1)[0]
    stages = [family.stage(model, r) for r in range(regions)]
    out = x
    for stage in stages:
        out = stage(out)
    assert torch.equal(family.loss(out, y), model(x, y))
    owned = [id(p) for s in stages for p in s.parameters()]
    assert len(owned) == len(set(owned)) and set(owned) == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_region_probe_runs_the_captured_graph_to_the_eager_loss(name):
    result = region_vs_eager(FAMILIES[name], FAMILIES[name].quick, reps=1)
    assert result["loss_gap"] == 0.0
    assert all(math.isfinite(v) and v > 0 for k, v in result.items() if k.endswith("_ms"))


def test_families_suite_is_registered():
    assert BY_NAME["families"].module == "families"
