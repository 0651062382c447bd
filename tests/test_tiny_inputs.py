"""Tiny hostile inputs answer with their diagnostic, quickly and in bounded memory: each `piper check`
or `piper import` runs in a subprocess under a 2 GiB address-space limit (RLIMIT_AS). The subprocess
time-out only detects a hang; no test asserts on time."""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import piper
from piper.compiler.planning import compile_directives
from piper.frontend.capture import Program
from piper.frontend.directives import Split
from piper.ir.size import MAX_COMPUTES

ADDRESS_SPACE = 2 << 30
HANG = 300          # seconds: far past any answer; only a hang reaches it
BIG = "9" * 5000


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def piper_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`piper ARGS` in a subprocess under the address-space limit."""
    return subprocess.run([sys.executable, "-m", "piper.cli", *args], capture_output=True, text=True,
                          timeout=HANG, preexec_fn=_limit, cwd=cwd)


def check_codes(tmp_path, text: str, *flags) -> list[str]:
    path = tmp_path / "hostile.pps"
    path.write_text(text)
    done = piper_cli("check", "--format", "json", str(path), *flags)
    assert "internal-error" not in done.stdout + done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 1), (done.returncode, done.stderr)
    return [d["code"] for d in json.loads(done.stdout)]


HOSTILE = {
    "4,000,000 microbatches": ("mesh pp=2\nsplit MB into 4000000\nplace PP=0 on pp[0]\nplace PP=1 on pp[1]\n",
                               "value-out-of-range"),
    "a region index of 2^62": ("mesh pp=2\nplace PP=4611686018427387904 on pp[0]\n", "value-out-of-range"),
    "a region index of 300,000": ("mesh pp=2\nplace PP=300000 on pp[0]\n", "value-out-of-range"),
    "dualpipev(microbatches=100000)": ("mesh pp=2\nuse dualpipev(microbatches=100000) on pp\n",
                                       "value-out-of-range"),
    "zbv(microbatches=100000)": ("mesh pp=2\nuse zbv(microbatches=100000) on pp\n", "value-out-of-range"),
    "a 5,000-digit number": (f"mesh pp=2\nlet x = {BIG}\nsplit MB into x\n", "value-out-of-range"),
    "a 5,000-digit mesh axis": (f"mesh pp={BIG}\n", "value-out-of-range"),
    "a mesh of 2^21 devices": ("mesh dp=2048, pp=1024\nshard batch over dp\n", "value-out-of-range"),
    "a loop to 2^62": ("mesh pp=2\nfor i in 0..4611686018427387904:\n    split MB into 2\n", "loop-limit"),
    "nested loops of 10^6 turns": ("mesh pp=2\nfor i in 0..1000:\n    for j in 0..1000:\n        let k = i\n",
                                   "loop-limit"),
    "a long expression in a loop": ("mesh pp=2\nlet y = 1\nfor i in 0..400000:\n    let x = "
                                    + "+".join(["y"] * 90) + "\n", "loop-limit"),
    "a slot line of 3,000 items in a loop": (
        "mesh pp=2\nsplit MB into 8\nplace PP=0 on pp[0]\norder PP=0:\n    for i in 0..100000:\n        "
        + "; ".join(f"F(MB={j % 8})" for j in range(3000)) + "\n", "loop-limit"),
    "deep expressions": ("mesh pp=2\nlet x = " + "(1+" * 5000 + "1" + ")" * 5000 + "\n", "nesting-limit"),
    "5,000 minus signs": ("mesh pp=2\nlet x = " + "-" * 5000 + "1\n", "nesting-limit"),
    "deep blocks": ("mesh pp=2\n" + "".join("    " * i + "if true:\n" for i in range(300)) + "    " * 300
                    + "let x = 1\n", "nesting-limit"),
    "a plan of 2^25 passes": ("mesh dp=1024, pp=512\nuse one_f_one_b(microbatches=64) on pp\n", "plan-too-large"),
    "1,024 microbatches of 64 regions on 16 devices each": (
        "mesh dp=16, pp=64\nuse one_f_one_b(microbatches=1024) on pp\nshard batch over dp\n", "plan-too-large"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_tiny_hostile_script_gets_its_diagnostic(tmp_path, name):
    text, code = HOSTILE[name]
    assert code in check_codes(tmp_path, text)


def test_regions_past_the_limit_are_a_diagnostic(tmp_path):
    text = "mesh pp=2\nuse one_f_one_b(microbatches=4) on pp\n"
    assert "value-out-of-range" in check_codes(tmp_path, text, "--regions", "PP=1000000000")
    path = tmp_path / "s.pps"
    path.write_text(text)
    done = piper_cli("check", str(path), "--regions", f"PP={BIG}")
    assert done.returncode == 2 and "5,000-digit number" in done.stderr and BIG not in done.stderr


def test_the_mesh_limit_holds_in_python():
    for spec in ({"dp": 2**21}, {"dp": 2048, "pp": 1024}, {"dp": 10**5000}, {"dp": BIG}, f"dp={BIG}"):
        with pytest.raises(piper.PiperError) as err:
            piper.Mesh.of(spec)
        (d,) = err.value.diagnostics
        assert d.code == "bad-mesh" and BIG not in d.message and d.hint
    with pytest.raises(piper.PiperError, match="at most 1,048,576"):
        piper.Mesh((("dp", 2**21),))
    assert piper.Mesh.of({"dp": 1024, "pp": 1024}).world_size == 1 << 20


def test_a_python_strategy_past_the_plan_limit_is_refused_before_splitting():
    mesh = piper.Mesh.of({"pp": 2})
    with pytest.raises(piper.PiperError) as err:
        compile_directives(Program.chain({"PP": 2}), mesh, [Split("MB", MAX_COMPUTES)])
    assert err.value.diagnostics[0].code == "plan-too-large"


# ---- piper import of a torch schedule CSV

def import_csv(tmp_path, data: bytes, name: str = "sched.csv") -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_bytes(data)
    done = piper_cli("import", str(path))
    assert "internal-error" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    return done


@pytest.mark.parametrize("data, said", [
    (b"0F0,\xff\xfe0B0\n", "not UTF-8"),
    (b"0F" + BIG.encode() + b"\n", "5,000 digits"),
    (b"0F0,9000F0\n", "past the last of the stages"),
    (b"0F0,0F100000\n", "past the last of the microbatches"),
    (b'"' + b"x" * 200_000 + b'"\n', "field larger than field limit"),
    (b"0F0\x00,1F0\n", "cannot read action"),
])
def test_a_bad_csv_is_a_diagnostic(tmp_path, data, said):
    done = import_csv(tmp_path, data)
    assert done.returncode == 1 and "bad-schedule-csv" in done.stderr and said in done.stderr
    assert BIG not in done.stderr


def test_a_huge_csv_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "huge.csv"
    with open(path, "wb") as f:
        f.truncate(50 * 1024 * 1024)          # sparse: 50 MB on paper
    done = piper_cli("import", str(path))
    assert done.returncode == 1 and "bad-schedule-csv" in done.stderr and "16,777,216" in done.stderr


def test_a_csv_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.csv")
    done = piper_cli("import", str(tmp_path / "pipe.csv"))
    assert done.returncode == 1 and "pipe (FIFO)" in done.stderr


def test_a_good_csv_still_imports(tmp_path):
    done = import_csv(tmp_path, b"0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert done.returncode == 0 and "split MB into 2" in done.stdout
