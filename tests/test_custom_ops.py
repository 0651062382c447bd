"""Custom ops in a model's graph resolve on the workers, whatever namespace registered them;
`import piper` gives `piper.nn` without importing torch until it is used."""
import subprocess
import sys

import pytest
import torch

from piper.dsl import load_strategy
from piper.frontend.capture import capture
from piper.runtime.launch.packed_graphs import pack
from piper.testing import train_both
from tests.custom_op_model import WithCustomOp
from tests.helpers import assert_same

XY = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64))


def test_a_custom_op_travels_with_the_module_that_defines_it():
    program = capture(WithCustomOp().double(), XY)
    ops = [t for op, _, t, *_ in pack(program.regions[0].graph).nodes if hasattr(t, "qualname")]
    custom = [op for op in ops if op.qualname.startswith("pipertest.")]
    assert [(op.qualname, op.module) for op in custom] == [("pipertest.scaled_tanh.default",
                                                           "tests.custom_op_model")]
    assert all(op.module is None for op in ops if op.qualname.startswith("aten."))


def test_a_process_that_never_imported_the_module_resolves_the_op(tmp_path):
    # What a worker does: unpickle the packed graph and rebuild it, in a fresh interpreter.
    import pickle

    program = capture(WithCustomOp().double(), XY)
    (tmp_path / "graph.pkl").write_bytes(pickle.dumps(pack(program.regions[0].graph)))
    code = ("import pickle, sys; from piper.runtime.launch.packed_graphs import unpack; "
            "assert 'tests.custom_op_model' not in sys.modules; "
            f"gm = unpack(pickle.loads(open({str(tmp_path / 'graph.pkl')!r}, 'rb').read())); "
            "print(sorted(str(n.target) for n in gm.graph.nodes if 'pipertest' in str(n.target)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr
    assert "pipertest.scaled_tanh.default" in out.stdout


def test_an_op_whose_module_is_gone_is_named(tmp_path):
    from piper.diagnostics import PiperError
    from piper.runtime.launch.packed_graphs import _Op

    with pytest.raises(PiperError) as err:
        _Op("nowhere.thing.default", "no_such_package.ops").resolve()
    assert err.value.code == "missing-op"
    assert "`nowhere::thing`" in str(err.value) and "no_such_package" in str(err.value)


@pytest.mark.usefixtures("ray_cluster")
def test_a_model_with_its_own_custom_op_trains_under_dp():
    assert_same(train_both(WithCustomOp().double(), load_strategy("use dp() on dp\n"), mesh={"dp": 2},
                           batches=[XY] * 3))


def test_piper_nn_comes_with_import_piper_but_torch_only_when_used():
    code = ("import sys, piper; assert 'torch' not in sys.modules, 'torch at import'; "
            "m = piper.nn.MoE(4, 8, 2, 1); print(type(m).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["MoE", "True"]
