"""Building big acyclic structures (scripts' directives, the IR, plans) with the
cyclic garbage collector paused: a few lines shared by `piper check` and compilation."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def no_cycle_collection():
    """The IR is hundreds of thousands of small acyclic objects: the cyclic
    collector would re-scan them again and again while they are built.

    What survives (the compiled IR and plans) lives as long as the job, so it
    joins the oldest generation directly: otherwise the first young collection
    after this scans every object compiled (0.2 s at 200k nodes), only to
    promote them all. Skipped if anything is frozen already (gc.freeze is the
    caller's, then), as unfreezing would release it.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            if not gc.get_freeze_count():
                gc.freeze()       # every tracked object, young ones included...
                gc.unfreeze()     # ...back, into the oldest generation
            gc.enable()
