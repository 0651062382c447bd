"""Running a region cut at its collectives (`piper.ir.region_cut`): its pieces and the
exchanges between them, each one action of the plan.

Under tensor parallelism the same holds for the TP collectives: a block under `shard
columns/rows` runs as `0F3 0TP_F3.0 0F3.1 0TP_F3.1 0F3.2 ...`, each `TP` exchange one
all-reduce, all-gather or reduce-scatter issued by the plan (`tensor_exchanges`).

Under `shard experts` the plan holds, for one forward of a region with one MoE
layer (keys as `piper show` prints them):

    0F3  0ALL_TO_ALL_F3.0  0F3.1  0ALL_TO_ALL_F3.1  0F3.2          (route | dispatch | experts | combine | rest)

and its backward the mirror image, `0B3.2 0ALL_TO_ALL_B3.1 0B3.1
0ALL_TO_ALL_B3.0 0B3` (BI likewise; BW stays one action). Each piece is run
and differentiated on its own, like a pipeline stage: the values it reads
from earlier pieces and exchanges become leaves, and its backward hands
their gradients back to where they came from. An exchange action issues
its all-to-all asynchronously on the expert group of the calling lane and
returns; the piece after it waits for it (the plan's edge), so anything the
plan puts between them, such as the other lane's compute in an overlapped
slot, runs while the tokens travel.

A dispatch exchanges the per-expert counts first (a small blocking
all-to-all: the row split sizes depend on them, and Gloo does not check that
split sizes agree), then sends the rows. A combine sends them back with the
same splits, reversed. Backward exchanges run the same all-to-alls the other
way; every member issues every exchange, with zero rows where no gradient
reached, so all members of a group issue the same collectives in the same order.
"""
from __future__ import annotations

from ...ir.dag import node_key
from ...ir.region_cut import Cut, cut
from .cut_pass import PARAM, VALUE, _Pass  # noqa: F401 - the pass and its input kinds stay importable from here
from .piece_backward import PieceBackward
from .piece_exchanges import PieceExchanges
from .piece_forward import PieceForward
from .piece_split_backward import PieceSplitBackward


class Pieces(PieceForward, PieceExchanges, PieceBackward, PieceSplitBackward):
    """The cut regions of one device and the microbatches in flight through them.

    Forward pieces (`piece_forward`), exchanges (`piece_exchanges`), backward pieces
    (`piece_backward`) and BI/BW (`piece_split_backward`) are mixed in; each action's
    method takes the executor (`ex`) and the action.
    """

    def __init__(self, cuts: dict[int, Cut]):
        self.cuts = cuts
        self.passes: dict[tuple[int, int], _Pass] = {}
        self._split: dict[tuple[int, int], bool] = {}     # (region, piece) -> BW resumes from BI

    def __contains__(self, region: int) -> bool:
        return region in self.cuts

    def __bool__(self) -> bool:
        return bool(self.cuts)

    @staticmethod
    def pass_key(node) -> str:
        """The token of the pass a piece belongs to (its piece 0): `0BI3.2` -> `0BI3`."""
        return node_key(node.op, node.region, node.mb)


def cut_regions(spec, experts) -> Pieces:
    """The regions this device's plan runs as pieces (its plan names a piece of them), cut as the
    compiler cut them (`piper.compiler.exchanges`): at the MoE layers under `shard experts`, for
    this device's expert group, and at the TP collectives under tensor parallelism."""
    regions = {a.node.region for a in spec.plan if a.node.is_compute and a.node.value}
    if not regions:
        return Pieces({})
    size = experts.lanes[0].size if experts is not None else 1
    tensor = getattr(spec, "tensor", None) is not None
    return Pieces({r: cut(spec.regions[r].graph, size, experts=experts is not None, tensor=tensor)
                   for r in sorted(regions)})
