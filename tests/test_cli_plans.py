"""`piper show` and `piper simulate`: plans and predictions for a script, without running it."""
from piper.cli import main


def test_show_prints_each_devices_plan(capsys):
    assert main(["show", "stdlib/one_f_one_b.pps", "--regions", "PP=2", "--mesh", "pp=2",
                 "--set", "microbatches=2"]) == 0
    out = capsys.readouterr().out
    plans = out.split("\nlegend")[0].strip().split("\n\n")
    assert plans[0].splitlines() == ["rank 0 (pp=0): 9 actions"] + [f"  {i}  {key}" for i, key in enumerate(
        "0F0 0SEND_F0>1.0 0F1 0SEND_F1>1.0 0RECV_B0<1.0 0B0 0RECV_B1<1.0 0B1 0UPD".split(), 1)]
    # Receives are posted as soon as their send is issued, ahead of the compute that waits on them.
    assert [line.split()[-1] for line in plans[1].splitlines()[1:]] == \
        "1RECV_F0<0.0 1F0 1RECV_F1<0.0 1B0 1SEND_B0>0.0 1F1 1B1 1SEND_B1>0.0 1UPD".split()
    assert "RSEND_FM>P.V   send forward value V of microbatch M" in out     # the legend


def test_show_grid_puts_devices_side_by_side(capsys):
    assert main(["show", "stdlib/one_f_one_b.pps", "--regions", "PP=2", "--mesh", "pp=2",
                 "--set", "microbatches=2", "--layout", "grid", "--no-legend"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("  ") == ["", "rank 0 (pp=0)", "rank 1 (pp=1)"] or lines[0].split() == \
        ["rank", "0", "(pp=0)", "rank", "1", "(pp=1)"]
    assert lines[1].split() == ["1", "0F0", "1RECV_F0<0.0"] and lines[9].split() == ["9", "0UPD", "1UPD"]
    assert len(lines) == 10         # no legend


def test_show_ir_round_trips(capsys):
    from piper.ir.dag import parse_ir

    assert main(["show", "examples/gpt_zero3_1f1b.pps", "--regions", "PP=2", "--what", "ir"]) == 0
    ir = parse_ir(capsys.readouterr().out)
    assert ir.microbatches == 8 and ("params", "dp") in ir.sharding


def test_simulate_predicts_the_1f1b_bubble(capsys):
    assert main(["simulate", "stdlib/one_f_one_b.pps", "--regions", "PP=4", "--mesh", "pp=4",
                 "--set", "microbatches=8", "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "predicted step 33" in out            # (m + p - 1)(F + B) with F=1, B=2
    assert "rank 3   |   FBBFBB" in out


def test_simulate_takes_costs(capsys):
    assert main(["simulate", "stdlib/gpipe.pps", "--regions", "PP=2", "--mesh", "pp=2",
                 "--set", "microbatches=2", "--costs", "F=2,B=4"]) == 0
    assert "predicted step 18" in capsys.readouterr().out   # (2 + 2 - 1) * (2 + 4)


def test_simulate_bad_costs_is_a_usage_error(capsys):
    assert main(["simulate", "stdlib/gpipe.pps", "--regions", "PP=2", "--mesh", "pp=2", "--costs", "F=x"]) == 2
    assert "--costs" in capsys.readouterr().err


def test_every_stdlib_and_example_script_checks_clean(capsys):
    import glob

    files = sorted(glob.glob("stdlib/*.pps")) + sorted(glob.glob("examples/*.pps"))
    assert len(files) >= 15
    assert main(["check", *files]) == 0
    # Nothing but notes that the library files, which declare no mesh, had their plans left unchecked.
    heads = [line for line in capsys.readouterr().out.splitlines() if line and not line.startswith(" ")]
    assert heads and all(h.startswith("note[analysis-unavailable]: stdlib/") for h in heads)
    # With their models' regions too: the whole compile, deadlock check included.
    assert main(["check", "examples/gpt_zero3_1f1b.pps", "--regions", "PP=2"]) == 0
    for script in ("examples/gpt_dualpipev.pps", "examples/gpt_zbv.pps", "examples/gpt_zero2_interleaved.pps"):
        assert main(["check", script, "--regions", "PP=4"]) == 0, script


def test_simulate_on_shared_cores(capsys):
    """--cores: four devices on two cores take at least their total work / 2."""
    args = ["simulate", "stdlib/gpipe.pps", "--regions", "PP=4", "--mesh", "pp=4", "--set", "microbatches=8"]
    assert main(args) == 0
    assert "predicted step 33" in capsys.readouterr().out        # (8 + 4 - 1) * 3
    assert main(args + ["--cores", "2"]) == 0
    assert "predicted step 48" in capsys.readouterr().out        # 4 devices * 8 * 3 / 2 cores
