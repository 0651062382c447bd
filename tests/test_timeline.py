"""`piper show --timeline`: an SVG (or HTML) picture of the per-device schedule."""
import xml.etree.ElementTree as ET

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
