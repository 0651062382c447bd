"""What a user reads when a `use`d strategy warns or does not fit the model: the user's own line,
once, and a hint that never proposes the schedule already in use."""
import torch

import piper
from piper.cli import main


def _check(tmp_path, capsys, text: str, *args: str) -> str:
    script = tmp_path / "job.pps"
    script.write_text(text)
    main(["check", "--format", "text", str(script), *args])
    return capsys.readouterr().out


def test_a_stdlib_warning_points_at_the_use_line_once(tmp_path, capsys):
    out = _check(tmp_path, capsys, "mesh dp=1\nuse zero3() on dp\n")
    assert out.count("warning[shard-size-one]") == 1
    assert out.startswith(f"{tmp_path / 'job.pps'}:2:1: warning[shard-size-one]: `shard batch, optimizer, grads, "
                          "params over dp`")
    assert "zero3.pps:22" not in out.splitlines()[0]     # the stdlib line is a label, not the place
    assert "raised by this line of the strategy" in out


def test_the_scripts_own_lines_over_one_device_warn_once(tmp_path, capsys):
    out = _check(tmp_path, capsys, "mesh dp=1, pp=2\nshard batch over dp\nshard optimizer, grads over dp\n"
                 "place PP=0 on pp[0]\nplace PP=1 on pp[1]\n", "--regions", "PP=2")
    assert out.count("warning[shard-size-one]") == 1 and ":2:1: warning" in out
    assert "also shards over `dp`" in out


def test_a_schedule_too_long_for_the_model_never_suggests_itself(tmp_path, capsys):
    out = _check(tmp_path, capsys, "mesh pp=4\nuse one_f_one_b(microbatches=4) on pp\n", "--regions", "PP=2")
    assert "error[unknown-region]" in out and "one_f_one_b`" not in out.split("hint:")[1]
    assert "shrink the pipeline axis to 2 devices" in out
    # An interleaved schedule holds several regions per device: one region each is a real way out.
    out = _check(tmp_path, capsys, "mesh pp=2\nuse interleaved_1f1b(microbatches=4, virtual=2) on pp\n",
                 "--regions", "PP=2")
    assert "(`one_f_one_b`)" in out.split("hint:")[1]


class _Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(self.a(x)), y)


def test_a_model_without_regions_is_told_so_by_the_api(tmp_path):
    for text in ("mesh pp=2\nuse one_f_one_b(microbatches=2) on pp\n",
                 "mesh pp=2\nsplit MB into 2\nplace PP=0 on pp[0]\nplace PP=1 on pp[1]\n"):
        script = tmp_path / "s.pps"
        script.write_text(text)
        try:
            piper.compile(_Plain(), (torch.randn(4, 4), torch.randn(4, 1)), strategy=str(script))
        except piper.PiperError as err:
            d = err.diagnostics[0]
        else:
            raise AssertionError("a two-stage schedule over a one-region model compiled")
        assert d.code == "unknown-region" and "no annotated regions" in d.message
        assert "piper.annotate" in d.hint and "piper.annotate_modules" in d.hint and "one_f_one_b" not in d.hint
        assert d.span.file == str(script)


# ---- the deadlock's suggested swap: applied, it must check clean

def _order_line(items) -> str:
    return "; ".join(f"{op}(MB={mb})" for op, mb in items)


def _script(order0, order1) -> str:
    return (f"mesh pp=2\nsplit MB into {len(order0) // 2}\nplace PP=0 on pp[0]\nplace PP=1 on pp[1]\n"
            f"order PP=0:\n    {_order_line(order0)}\norder PP=1:\n    {_order_line(order1)}\n")


def _orders(microbatches: int):
    """Every order of F and B over the microbatches in which each F comes before its B."""
    import itertools

    items = [(op, mb) for mb in range(microbatches) for op in "FB"]
    for perm in itertools.permutations(items):
        if all(perm.index(("F", mb)) < perm.index(("B", mb)) for mb in range(microbatches)):
            yield perm


def test_every_suggested_swap_removes_the_deadlock(tmp_path, capsys):
    import json
    import re

    suggested = unsuggested = 0
    orders = list(_orders(2))
    for order0 in orders:
        for order1 in orders:
            out = _check(tmp_path, capsys, _script(order0, order1), "--regions", "PP=2", "--format", "json")
            found = [d for d in json.loads(out) if d["code"] == "deadlock"]
            if not found:
                continue
            swap = re.match(r"swap (\d)(F|B)(\d) and (\d)(F|B)(\d) in rank (\d)'s order", found[0]["hint"] or "")
            if swap is None:
                unsuggested += 1
                assert "swapping" not in json.dumps(found[0]["labels"])
                continue
            suggested += 1
            region, op_a, mb_a, _, op_b, mb_b, rank = swap.groups()
            fixed = [list(order0), list(order1)][int(rank)]
            i, j = fixed.index((op_a, int(mb_a))), fixed.index((op_b, int(mb_b)))
            fixed[i], fixed[j] = fixed[j], fixed[i]
            both = (fixed, order1) if rank == "0" else (order0, fixed)
            after = _check(tmp_path, capsys, _script(*both), "--regions", "PP=2")
            assert "error" not in after, (order0, order1, swap.group(0), after)
    assert suggested > 0, unsuggested


def test_without_a_swap_that_runs_no_pair_is_named(tmp_path, capsys, monkeypatch):
    import json

    from piper.compiler import schedule

    monkeypatch.setattr(schedule, "MAX_SWAPS_TRIED", 0)      # as if no swap of two items ran through
    out = _check(tmp_path, capsys, _script([("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                                           [("F", 1), ("B", 1), ("F", 0), ("B", 0)]),
                 "--regions", "PP=2", "--format", "json")
    d, = json.loads(out)
    assert d["code"] == "deadlock" and not d["hint"].startswith("swap")
    assert d["labels"] and all("before" not in label["message"] and "swap" not in label["message"]
                               for label in d["labels"])
