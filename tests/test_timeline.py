"""`piper show --timeline`: an SVG (or HTML) picture of the per-device schedule."""
import math
import xml.etree.ElementTree as ET

import pytest

from piper.cli import main

NS = "{http://www.w3.org/2000/svg}"


def test_timeline_svg_has_a_row_per_device_and_a_box_per_action(tmp_path):
    path = tmp_path / "t.svg"
    assert main(["show", "stdlib/one_f_one_b.pps", "--regions", "PP=8", "--mesh", "pp=8",
                 "--set", "microbatches=32", "--timeline", str(path)]) == 0
    root = ET.parse(path).getroot()
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert [t for t in texts if t and t.startswith("device ")] == [f"device {r} (pp={r})" for r in range(8)]
    titles = [t.text.split()[0] for t in root.iter(f"{NS}title")]
    computes = [k for k in titles if k[-1].isdigit() and ("F" in k or "B" in k) and "_" not in k]
    assert len(computes) == 8 * 32 * 2                       # every F and B of every device
    assert sum(1 for k in titles if "SEND" in k or "RECV" in k) == 7 * 32 * 2 * 2
    assert "31" in texts                                      # microbatch numbers are drawn
    assert int(root.get("width")) >= 1400


def test_timeline_html_wraps_the_svg(tmp_path):
    path = tmp_path / "t.html"
    assert main(["show", "stdlib/dualpipev.pps", "--regions", "PP=4", "--mesh", "pp=2",
                 "--set", "microbatches=4", "--timeline", str(path)]) == 0
    text = path.read_text()
    assert text.startswith("<!doctype html>") and "<svg" in text and "BI" in text


def _ticks(root) -> list[float]:
    """The time axis's labels (the texts under its tick marks), in order."""
    axis = [t for t in root.iter(f"{NS}text") if t.get("font-size") == "10"]
    return [float(t.text) for t in axis]


def test_tick_spacing_for_any_span():
    """1, 2 or 5 times a power of ten, at most 12 intervals and more than 2 over the span; the span
    below 12 units gave 1e-9 (or 1e-10), and the axis's loop ran for hours."""
    from piper.compiler.timeline import _tick

    for span in (6.0, 11.9, 12.0, 100.0, 0.5, 0.006, 2e-5, 3.7e-7, 1e6, 123456.0):
        step = _tick(span)
        assert 2 < span / step <= 12 + 1e-6, (span, step)
        mantissa = step / 10 ** math.floor(math.log10(step) + 1e-12)
        assert min(abs(mantissa - k) for k in (1, 2, 5)) < 1e-9, (span, step)
    assert _tick(0.0) == 1.0 and _tick(-1.0) == 1.0


def test_timeline_of_a_step_shorter_than_twelve_units(tmp_path):
    """A 2-stage pipeline of one microbatch (6 units) with default costs, and the same in seconds:
    the axis has its ticks from 0 to the step."""
    path = tmp_path / "t.svg"
    assert main(["show", "stdlib/one_f_one_b.pps", "--regions", "PP=2", "--mesh", "pp=2",
                 "--set", "microbatches=1", "--timeline", str(path)]) == 0
    ticks = _ticks(ET.parse(path).getroot())
    assert ticks[0] == 0 and ticks[-1] == pytest.approx(6.0) and 3 <= len(ticks) <= 13
    assert main(["show", "stdlib/one_f_one_b.pps", "--regions", "PP=2", "--mesh", "pp=2",
                 "--set", "microbatches=2", "--costs", "F=0.0004,B=0.0008", "--timeline", str(path)]) == 0
    ticks = _ticks(ET.parse(path).getroot())
    assert ticks[0] == 0 and 3 <= len(ticks) <= 13 and ticks[-1] <= 0.0036 + 1e-12
    assert ticks == sorted(ticks) and len(set(ticks)) == len(ticks)


def test_timeline_of_an_empty_step():
    """A step of no time (every cost 0) still draws: one axis from 0 to 1."""
    from piper.compiler.simulate import Simulation
    from piper.compiler.timeline import svg

    sim = Simulation(0.0, {0: 0.0}, {0: [(0.0, 0.0, "0F0")]})
    root = ET.fromstring(svg(sim))
    assert _ticks(root)[0] == 0 and len(_ticks(root)) <= 13
