"""`piper.annotate(tag)`: mark a schedulable region inside a model's forward.

Each tag is numbered in trace order (the first `PP` scope is PP=0, the next
PP=1, ...) and scopes nest (an `EP` region inside a `PP` region carries both).
The numbers ride on `torch.fx.traceback.annotate`, which TorchDynamo keeps on
`node.meta["custom"]`. Outside capture the context manager does nothing.
"""
from __future__ import annotations

# Reset by capture before each trace; Dynamo replays the increments as side effects.
_counters: dict[str, int] = {}


def reset_counters() -> None:
    _counters.clear()


def annotate(tag: str):
    """Context manager: the ops inside form region `tag=<next index>`.

        with piper.annotate("PP"):
            x = self.blocks[0](x)
    """
    import torch.fx.traceback as fx_traceback  # here, so `import piper` does not load torch

    index = _counters.get(tag, 0)
    _counters[tag] = index + 1
    return fx_traceback.annotate({tag: index})


# `import piper.annotate` resolves to the function above (piper re-exports it),
# so the reset is reachable from it as well.
annotate.reset_counters = reset_counters
