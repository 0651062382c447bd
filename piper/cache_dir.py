"""Where Piper keeps what it caches on disk: `$PIPER_CACHE`, else `$XDG_CACHE_HOME/piper`, else
`~/.cache/piper` (the parser's tables, `piper tune`'s measurements). Nothing here imports torch."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """The cache folder (not created here): `PIPER_CACHE=/tmp/piper-cache piper tune ...` keeps
    tune's measurements and the parser's tables there."""
    chosen = os.environ.get("PIPER_CACHE")
    if chosen:
        return chosen
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "piper")
