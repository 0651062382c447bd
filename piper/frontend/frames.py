"""Which frames of a traceback or an fx node's stack trace are the user's own code.

A frame is the library's when its file lies inside the installed torch package or one of
Piper's own packages (`piper`, and `piper.dsl` which installs from `dsl/`), found by their
real locations. Matching substrings such as "/piper/" instead would also hide a user's model
file in a clone named `piper` (`~/piper/examples/gpt.py`) or anything under a folder `torch/`.
"""
from __future__ import annotations

import importlib.util
import os
import re
from functools import lru_cache

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


@lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in ("torch", "piper", "piper.dsl"):
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or ()) if spec else ():
            dirs.append(os.path.join(os.path.realpath(location), ""))
    return tuple(dirs)


def is_library_file(path: str) -> bool:
    """True for a file inside torch's or Piper's own packages.

    >>> is_library_file(torch.__file__), is_library_file("/home/me/piper/examples/gpt.py")
    (True, False)
    """
    return os.path.realpath(path).startswith(_library_dirs())


def last_user_frame(text: str) -> str | None:
    """The last `File "...", line N` of `text` outside the libraries, as `file:line`."""
    frames = [f for f in _FRAME.findall(text) if not is_library_file(f[0])]
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None
