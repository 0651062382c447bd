"""Caches Piper reads without being asked run no code, are the user's own and are bounded:
`piper check` reads no parser tables from disk (a planted pickle runs nothing), the cache folder
is made private, and `piper tune`'s cache file is ignored with one line when it is another
user's, writable by others, a FIFO or a device (never a hang, never a MemoryError)."""
from __future__ import annotations

import hashlib
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from piper.compiler import tune_cache
from piper.compiler.tune_cache import cached

ROOT = Path(__file__).resolve().parent.parent


class _Planted:
    """Unpickled, it makes the folder `marker`: what an attacker's `os.system` would be."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_check_runs_no_pickle_planted_in_the_cache_folder(tmp_path):
    marker = tmp_path / "code-ran"
    grammar = (ROOT / "dsl" / "grammar.lark").read_text(encoding="utf-8")
    # Where the parser kept lark's table cache (a pickle read before its hash was compared).
    name = f"grammar-{hashlib.sha256(grammar.encode()).hexdigest()[:12]}-py{sys.version_info[0]}{sys.version_info[1]}.lark"
    planted = b"0" * 64 + b"\n" + pickle.dumps(_Planted(str(marker))) + pickle.dumps(_Planted(str(marker)))
    cache, xdg, home = tmp_path / "cache", tmp_path / "xdg", tmp_path / "home"
    for folder in (cache, xdg / "piper", home / ".cache" / "piper"):
        folder.mkdir(parents=True, mode=0o700)
        (folder / name).write_bytes(planted)
    base = {k: v for k, v in os.environ.items() if k not in ("PIPER_CACHE", "XDG_CACHE_HOME")}
    for env in ({**base, "PIPER_CACHE": str(cache), "PIPER_PARSER_CACHE": "1"},
                {**base, "XDG_CACHE_HOME": str(xdg)}, {**base, "HOME": str(home)}):
        done = subprocess.run([sys.executable, "-m", "piper.cli", "check", "examples/gpt_zero3_1f1b.pps"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "all checks passed" in done.stderr, done.stderr[-2000:]
        assert not marker.exists()
    for folder in (cache, xdg / "piper", home / ".cache" / "piper"):
        assert os.listdir(folder) == [name]          # nothing read, nothing written


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("PIPER_CACHE", str(folder))
    return folder


def _store(key: dict) -> str:
    """A good cache file for `key`, as tune writes it; returns its path."""
    assert cached(key, lambda: {"x": 1.5}) == {"x": 1.5}
    return tune_cache.cache_path(tune_cache.cache_key(key))


def _again(key: dict) -> tuple[object, list[str]]:
    said: list[str] = []
    return cached(key, lambda: {"x": 2.5}, log=said.append), said


def test_the_cache_folder_and_files_are_made_private(cache):
    old = os.umask(0o002)                  # a umask that leaves group write on
    try:
        path = _store({"what": "private"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert _again({"what": "private"}) == ({"x": 1.5}, [])        # read back: it is the user's own


def test_a_group_writable_cache_file_is_ignored_with_one_line(cache):
    path = _store({"what": "group"})
    os.chmod(path, 0o664)
    value, said = _again({"what": "group"})
    assert value == {"x": 2.5} and len(said) == 1
    assert "ignoring the cache file" in said[0] and "may be written by others (mode 664)" in said[0]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600                    # measured and stored anew
    assert _again({"what": "group"}) == ({"x": 2.5}, [])


def test_a_cache_folder_others_may_write_is_not_read_or_written(cache):
    path = _store({"what": "folder"})
    os.chmod(cache, 0o777)
    try:
        for _ in range(2):                                      # the second time too: nothing was kept
            value, said = _again({"what": "folder"})
            assert value == {"x": 2.5} and len(said) == 1 and "its folder" in said[0] and "mode 777" in said[0]
    finally:
        os.chmod(cache, 0o700)
    assert _again({"what": "folder"}) == ({"x": 1.5}, [])                  # the old file, untouched


def test_another_users_cache_file_is_ignored_with_one_line(cache, monkeypatch):
    _store({"what": "owner"})
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)          # the file is now someone else's
    value, said = _again({"what": "owner"})
    assert value == {"x": 2.5} and len(said) == 1 and f"belongs to another user (uid {me})" in said[0]


def test_a_fifo_as_the_cache_file_is_ignored_not_waited_on(cache):
    key = {"what": "fifo"}
    path = tune_cache.cache_path(tune_cache.cache_key(key))
    os.mkfifo(path, 0o600)
    value, said = _again(key)
    assert value == {"x": 2.5} and len(said) == 1 and "(FIFO)" in said[0]


def test_dev_zero_as_the_cache_file_is_ignored_not_read(cache, monkeypatch):
    key = {"what": "zero"}
    path = tune_cache.cache_path(tune_cache.cache_key(key))
    os.symlink("/dev/zero", path)
    value, said = _again(key)
    assert value == {"x": 2.5} and len(said) == 1 and "ignoring the cache file" in said[0]
    # The owner and mode checks aside (root owns /dev/zero, and may write it), the bounded reader
    # refuses a device on its own.
    os.unlink(path)
    os.symlink("/dev/zero", path)
    monkeypatch.setattr("piper.cache_dir.distrusted", lambda *a, **k: None)
    value, said = _again(key)
    assert value == {"x": 2.5} and len(said) == 1 and "character device" in said[0]


def test_an_oversized_cache_file_is_ignored(cache, monkeypatch):
    path = _store({"what": "big"})
    monkeypatch.setattr(tune_cache, "MAX_BYTES", os.path.getsize(path) - 1)
    value, said = _again({"what": "big"})
    assert value == {"x": 2.5} and len(said) == 1 and "over the" in said[0]


def test_without_a_log_the_line_goes_to_stderr(cache, capsys):
    path = _store({"what": "stderr"})
    os.chmod(path, 0o666)
    assert cached({"what": "stderr"}, lambda: {"x": 2.5}) == {"x": 2.5}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("piper: ignoring the cache file") and "Traceback" not in err
