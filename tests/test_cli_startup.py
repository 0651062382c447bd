"""`piper check` starts like a linter: checking a script, alone or planned against
`--regions`, never imports torch or Ray (each test runs the command in a fresh
interpreter, since this one has long imported both)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Runs `piper check ARGS...` as the console script does, then reports the exit
# status and which heavy packages the run imported.
DRIVER = """
import json, sys
from piper.cli import main
status = main(sys.argv[1:])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "ray", "numpy"})
print(json.dumps({"status": status, "heavy": heavy}), file=sys.stderr)
"""


def _check(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", DRIVER, "check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("extra", [(), ("--regions", "PP=2"), ("--regions", "PP=2", "--format", "json")])
def test_check_imports_neither_torch_nor_ray(extra):
    result = _check("examples/gpt_zero3_1f1b.pps", *extra)
    assert result == {"status": 0, "heavy": []}


def test_check_of_a_4d_plan_with_tensor_parallelism_imports_neither():
    # The compiler's cut of passes at their collectives reads graphs only where there are some.
    result = _check("examples/llama_tp_4d.pps", "--regions", "PP=2")
    assert result == {"status": 0, "heavy": []}


def test_check_of_a_bigger_plan_imports_neither(tmp_path):
    script = tmp_path / "big.pps"
    script.write_text("mesh dp=2, pp=8\nuse interleaved_1f1b(microbatches=16) on pp\nuse zero3() on dp\n")
    assert _check(str(script), "--regions", "PP=16") == {"status": 0, "heavy": []}


def test_check_reporting_a_deadlock_imports_neither(tmp_path):
    # Planning that finds a problem (1F1B needs a region per pipeline device) still stays light.
    script = tmp_path / "short.pps"
    script.write_text("mesh pp=4\nuse one_f_one_b(microbatches=4) on pp\n")
    result = _check(str(script), "--regions", "PP=2")
    assert result["status"] == 1 and result["heavy"] == []


def test_import_piper_is_light_but_complete():
    code = ("import sys, piper; api = [getattr(piper, n) for n in piper.__all__]; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr
