"""Hostile prototype programs: whatever the file, `piper import` answers with diagnostics that have codes.

Size, nesting and number length are bounded before work proportional to them
(piper/frontend/prototype_read.py); a wrong type anywhere is `bad-program-json`;
work per directive does not grow with the mesh its device numbers imply.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from piper.cli import main
from piper.diagnostics import PiperError
from piper.frontend.prototype import import_program, import_text, program_to_pps
from piper.frontend.prototype_directives import MAX_ERRORS
from piper.frontend.prototype_read import MAX_BYTES, MAX_DEPTH, MAX_DIGITS

DATA = Path(__file__).resolve().parent / "data" / "prototype"
PROGRAMS = sorted((DATA / "base-schedules").glob("*.json")) + sorted((DATA / "built").glob("*.json"))


def _codes(text: str) -> list[str]:
    with pytest.raises(PiperError) as err:
        import_text(text, file="h.json")
    return [d.code for d in err.value.diagnostics]


def _message(text: str) -> str:
    with pytest.raises(PiperError) as err:
        import_text(text, file="h.json")
    return err.value.diagnostics[0].message


SPLIT = '[{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": %s}]'
HOSTILE = {   # name -> (text, code)
    "deep": ("[" * 100_000 + "]" * 100_000, "program-too-large"),
    "deep, unclosed": ("[" * 100_000, "program-too-large"),
    "deep inside an order": ('[{"op": "order", "filters": ' + "[" * 40 + "]" * 40 + "}]", "program-too-large"),
    "5,000 digits": (SPLIT % ("9" * 5000), "program-too-large"),
    "5,000 digits, negative": (SPLIT % ("-" + "9" * 5000), "program-too-large"),
    "5,000-digit float": (SPLIT % ("9" * 5000 + ".5"), "bad-program-json"),
    "exponent": (SPLIT % "1e999999", "bad-program-json"),
    "NaN": (SPLIT % "NaN", "bad-program-json"),
    "Infinity": (SPLIT % "-Infinity", "bad-program-json"),
    "a count past 2^62": (SPLIT % str(2 ** 62 + 1), "bad-program-json"),
    "devices [[0]]": ('[{"op": "place", "filter": {"PP": 0}, "devices": [[0]]}]', "bad-program-json"),
    "devices true": ('[{"op": "place", "filter": {"PP": 0}, "devices": [true]}]', "bad-program-json"),
    "device past the mesh limit": ('[{"op": "place", "filter": {"PP": 0}, "devices": [1048576]}]',
                                   "bad-program-json"),
    "one far device": ('[{"op": "place", "filter": {"PP": 0}, "devices": [1048575]}]', "prototype-unsupported"),
    "two far apart": ('[{"op": "place", "filter": {"PP": 0}, "devices": [0, 1048575]},'
                      '{"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1048575]}]', "prototype-unsupported"),
    "filter a list": ('[{"op": "place", "filter": [["PP", 0]], "devices": [0]}]', "bad-program-json"),
    "filter value a list": ('[{"op": "place", "filter": {"PP": [0]}, "devices": [0]}]', "bad-program-json"),
    "filters an object": ('[{"op": "order", "filters": {"PP": 0}}]', "bad-program-json"),
    "PASS a number": ('[{"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": 1}]]}]', "bad-program-json"),
    "PASS an object": ('[{"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": {}}]]}]', "bad-program-json"),
    "op a list": ('[{"op": ["place"]}]', "bad-program-json"),
    "op missing": ('[{"filter": {}}]', "bad-program-json"),
    "bucket a string": ('[{"op": "replicate", "filter": {}, "devices": [0], "bucket_size": "100"}]',
                        "bad-program-json"),
    "dim_name a number": ('[{"op": "split", "filter": {}, "dim_name": 7, "num_microbatches": 2}]',
                          "bad-program-json"),
    "a number": ("7", "bad-program-json"),
    "a string": ('"place"', "bad-program-json"),
    "null": ("null", "bad-program-json"),
    "an object": ('{"op": "place"}', "bad-program-json"),
    "empty": ("", "bad-program-json"),
    "not closed": ('[{"op": "split",', "bad-program-json"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_text_is_a_diagnostic_with_a_code(name):
    text, code = HOSTILE[name]
    assert code in _codes(text)


def test_the_bounds_say_where_and_which():
    assert f"nest more than {MAX_DEPTH} deep" in _message("[" * 1000)
    assert "h.json:1:33:" in _message("[" * 1000)            # the first bracket past the bound
    assert "5,000 digits" in _message(SPLIT % ("9" * 5000)) and str(MAX_DIGITS) in _message(SPLIT % ("9" * 5000))
    nested = [[[[[0]]]]]
    assert _codes(json.dumps([{"op": "order", "filters": nested * 1}])) == ["bad-program-json"]   # 5 deep is fine
    assert _codes('[' * MAX_DEPTH + ']' * MAX_DEPTH) == ["bad-program-json"]     # at the bound: read, then refused


def test_a_program_larger_than_the_bound_is_read_no_further(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:                    # 4 GiB, sparse: reading it whole would take the memory
        f.truncate(4 << 30)
    with pytest.raises(PiperError) as err:
        import_program(str(big))
    assert err.value.diagnostics[0].code == "program-too-large"
    assert _codes("[" + " " * MAX_BYTES + "]") == ["program-too-large"]


def test_what_is_not_a_regular_file_or_not_utf8_is_refused(tmp_path, capsys):
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)                                # opening it would wait for a writer forever
    assert main(["import", str(fifo)]) == 1
    assert "not a regular file" in capsys.readouterr().err
    assert main(["import", str(tmp_path)]) == 1
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"op": "place", "filter": {"PP\xe9": 0}, "devices": [0]}]')
    assert main(["import", str(latin)]) == 1
    assert "not UTF-8" in capsys.readouterr().err
    sniffed = tmp_path / "program"                 # no .json: sniffed as bytes, so non-UTF-8 cannot fail there
    sniffed.write_bytes(b'  [{"op": "place", "filter": {"PP\xff": 0}, "devices": [0]}]')
    assert main(["import", str(sniffed)]) == 1
    assert "not UTF-8" in capsys.readouterr().err


def test_wide_meshes_cost_what_their_device_lists_cost():
    # 2,000 stages of 2 devices: a 4,000-device mesh, every place and replicate checked against it. Work per
    # place used to grow with the whole mesh (500 places took 51 s, cubic); it is the place's own devices now.
    n = 2000
    program = [{"op": "place", "filter": {"PP": s}, "devices": [s, n + s]} for s in range(n)]
    program += [{"op": "replicate", "filter": {"PP": s}, "devices": [s, n + s]} for s in range(n)]
    program += [{"op": "shard", "filter": {"PP": s, "EP": "*"}, "devices": [s, n + s]} for s in range(n)]
    text, _ = program_to_pps(program)
    assert text.splitlines()[1] == f"mesh dp=2, pp={n}" and f"place PP={n - 1} on pp[{n - 1}]" in text


def test_errors_stop_at_the_bound():
    with pytest.raises(PiperError) as err:
        program_to_pps([{"op": "plaec"}] * 100_000, file="h.json")
    found = err.value.diagnostics
    assert len([d for d in found if d.severity == "error"]) == MAX_ERRORS
    assert "reading stopped after" in found[-1].message


def test_messages_show_hostile_values_short_and_escaped():
    huge = "x" * 500_000
    for program in ([{"op": huge}], [{"op": "place", huge: 1}],
                    [{"op": "place", "filter": {huge + "-": 0}, "devices": [0]}],
                    [{"op": "place", "filter": {"PP": 0}, "devices": [list(range(10_000))]}],
                    [{"op": "\x1b[31m\u202e"}]):
        with pytest.raises(PiperError) as err:
            program_to_pps(program, file="h.json")
        for d in err.value.diagnostics:
            text = d.message + (d.hint or "")
            assert len(text) < 400 and "\x1b" not in text and "\u202e" not in text, text[:200]


def test_a_file_name_cannot_write_statements(tmp_path):
    file = tmp_path / "x\nshard batch over pp\n.json"
    file.write_text('[{"op": "replicate", "filter": {}, "devices": [0, 1]}]')
    text, _ = import_program(str(file))
    assert text.splitlines()[0].startswith("# imported from ") and "shard batch over pp" not in text.splitlines()[1:]


def _paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, path + (i,))


def _replaced(value, path, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], new)
    return copy


WRONG = [None, True, 1.5, -1, 2 ** 70, "x", "*", "", [], [[0]], {}, {"PP": 0}]


@pytest.mark.parametrize("path", [DATA / "base-schedules" / "pp2_dp2_ep2_custom_order.json",
                                  DATA / "base-schedules" / "pp2_dp2_ep2_zero3.json"], ids=lambda p: p.stem)
def test_a_wrong_type_anywhere_is_a_diagnostic(path):
    program = json.loads(path.read_text())
    cases = 0
    for where in _paths(program):
        for new in WRONG:
            try:
                text, warnings = program_to_pps(_replaced(program, where, new), file="p.json")
            except PiperError as err:
                assert err.diagnostics and all(d.code for d in err.diagnostics)
            else:
                assert text.startswith("# imported from")
            cases += 1
    assert cases > 500


HOSTILE_RUN = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from piper.cli import main
codes = [main(["import", path]) for path in sys.argv[1:]]
print(codes)
"""


def test_hostile_files_are_answered_within_a_2_gib_address_space(tmp_path):
    paths = []
    for i, (text, _) in enumerate(HOSTILE.values()):
        paths.append(tmp_path / f"h{i}.json")
        paths[-1].write_text(text)
    wide = [{"op": "place", "filter": {"PP": s}, "devices": [s, 20_000 + s]} for s in range(20_000)]
    (tmp_path / "wide.json").write_text(json.dumps(wide, separators=(",", ":")))
    paths.append(tmp_path / "wide.json")
    run = subprocess.run([sys.executable, "-c", HOSTILE_RUN, *map(str, paths)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip()) == [1] * len(paths)
    assert "Traceback" not in run.stderr and "internal-error" not in run.stderr


def test_a_file_without_json_in_its_name_is_sniffed_without_blocking(tmp_path, capsys):
    # `piper import FILE` tells a program from a CSV by its first bytes; what is not a regular file is
    # refused before that (a FIFO would block the open, /dev/zero the read), with the file's kind named.
    fifo = tmp_path / "schedule"
    os.mkfifo(fifo)
    assert main(["import", str(fifo)]) == 1
    assert "a pipe (FIFO), not a regular file" in capsys.readouterr().err
    assert main(["import", "/dev/zero"]) == 1
    assert "character device" in capsys.readouterr().err
    assert main(["import", "/proc/self/environ"]) == 1
    err = capsys.readouterr().err
    assert "kernel's files" in err and "PATH=" not in err
    latin = tmp_path / "schedule.csv"               # not UTF-8 and not a program: the CSV reader says so
    latin.write_bytes(b"\xff\xfe\x00rank,action\n")
    assert main(["import", str(latin)]) == 1
    assert "not UTF-8" in capsys.readouterr().err
    marked = tmp_path / "program.txt"               # a UTF-8 byte-order mark before the `[`
    marked.write_bytes(b'\xef\xbb\xbf [{"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4}]')
    assert main(["import", str(marked), "-o", str(tmp_path / "out.pps")]) == 0
    assert "split MB into 4" in (tmp_path / "out.pps").read_text()
    assert main(["import", str(tmp_path / "missing")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_long_tag_names_are_refused_with_a_short_message():
    for program in ([{"op": "place", "filter": {"P" * 5000: 0}, "devices": [0]}],
                    [{"op": "split", "filter": {}, "dim_name": "M" * 5000, "num_microbatches": 4}]):
        with pytest.raises(PiperError) as err:
            program_to_pps(program, file="h.json")
        d = err.value.diagnostics[0]
        assert d.code == "bad-program-json" and len(d.message + (d.hint or "")) < 300, d.message[:200]
