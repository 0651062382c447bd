"""tune's measurement cache: JSON with a version, read back only into the dataclasses named, and a
malformed, foreign or old file ignored (measured again) without a traceback."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from piper.compiler import tune_cache
from piper.compiler.runtime_costs import RuntimeModel
from piper.compiler.tune import Profile, profile, profile_types
from piper.compiler.tune_cache import CacheFormatError, cached, decode, encode
from piper.compiler.tune_calibration import Calibration

MODEL = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt.py") + ":small_gpt"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPER_CACHE", str(tmp_path))
    return tmp_path


def test_values_round_trip_with_their_types():
    cal = Calibration(RuntimeModel({"F": 1e-4, "RECV": 2e-5}, 0.001, 0.002, {0: 0.0, 3: 0.004}, 0.003),
                      background=0.01, cores=2, candidate="dp=2 pp=2", steps=(0.1, 0.12))
    data = json.loads(json.dumps(encode(cal)))
    back = decode(data, (Calibration, RuntimeModel))
    assert back == cal and back.runtime.skew == {0: 0.0, 3: 0.004} and isinstance(back.steps, tuple)
    assert decode(encode({"dtype": torch.bfloat16, 1: [None, True, (2.5,)]})) == \
        {"dtype": torch.bfloat16, 1: [None, True, (2.5,)]}


def test_only_the_named_dataclasses_are_made():
    data = encode(RuntimeModel({"F": 1.0}))
    with pytest.raises(CacheFormatError, match="does not hold"):
        decode(data, (Calibration,))
    # what a crafted file might name instead: nothing is imported or called
    for bad in ({"dataclass": "os.system", "fields": {}}, {"dtype": "load"}, {"set": [1]}, [1, 2],
                {"dataclass": "RuntimeModel", "fields": {"per_op": {}, "evil": 1}}):
        with pytest.raises(CacheFormatError):
            decode(bad, (RuntimeModel,))
    with pytest.raises(TypeError, match="cannot store"):
        encode({1, 2})


def test_a_profile_is_stored_as_json_and_read_back(cache):
    first = profile(MODEL, 2)
    files = glob.glob(str(cache / "tune-*"))
    assert files and all(f.endswith(".json") for f in files)
    assert not glob.glob(str(cache / "*.pkl"))
    with open(files[0], encoding="utf-8") as f:
        stored = json.load(f)
    assert stored["format"] == "piper-tune-cache" and stored["version"] == tune_cache.VERSION
    again = profile(MODEL, 2)
    assert isinstance(again, Profile) and again.forward == first.forward and again.saved == first.saved
    assert again.program.params == first.program.params
    assert [r.tags for r in again.program.regions] == [r.tags for r in first.program.regions]
    assert all(isinstance(s.dtype, torch.dtype) for s in again.program.params.values())
    assert Profile in profile_types()


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": "piper-tune-cache", "version": 2}',
                                  "\x80\x04\x95pickle", '{"format": "piper-tune-cache", "version": 3, '
                                  '"key": {}, "value": 1}'])
def test_a_malformed_or_foreign_file_is_ignored_and_measured_again(cache, text, capsys):
    key = {"what": "test"}
    path = tune_cache.cache_path(tune_cache.cache_key(key))
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
    said = []
    assert cached(key, lambda: {"x": 1.5}, log=said.append) == {"x": 1.5}
    assert len(said) == 1 and "ignoring the cache file" in said[0] and "measuring again" in said[0]
    assert "Traceback" not in capsys.readouterr().err
    assert cached(key, lambda: pytest.fail("measured again"), log=said.append) == {"x": 1.5}   # rewritten


def test_a_value_with_a_type_not_named_is_measured_again(cache):
    key = {"what": "calibration-test"}
    cached(key, lambda: RuntimeModel({"F": 1.0}), types=(RuntimeModel,))
    said = []
    assert cached(key, lambda: "fresh", types=(), log=said.append) == "fresh"
    assert said and "does not hold" in said[0]
