"""What capture makes: the `Program` (regions, values, parameters, buffers, batch) and its records, with
the two helpers capture and its passes (`capture_inputs`, `region_graphs`) share. Below all three, so
they do not import each other in a loop; `piper.frontend.capture` still names them for its readers.

    program = Program.chain("PP=4")      # an abstract chain of four regions, without torch
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..diagnostics import error
from ..lazy import LazyModule
from .frames import last_user_frame

# Imported on first use: planning with `--regions` (Program.chain) never needs torch.
torch = LazyModule("torch")
fx = LazyModule("torch.fx")

# An abstract chain (`--regions PP=N`) holds at most this many regions: as many as a script's
# tag indices can name (`dsl.values.MAX_TAG_INDEX`), 16 times the largest real schedule's 256.
MAX_REGIONS = 4096


def _count(count: int) -> str:
    """A count as text, without turning a 5,000-digit number into text."""
    return f"{count:,}" if abs(count) < 10**30 else f"(a {int(count.bit_length() * 0.30103) + 1:,}-digit number)"


# The kinds of region input, in the order a region's graph takes them.
PARAM, BUFFER, BATCH, VALUE = "param", "buffer", "batch", "value"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t) -> "TensorSpec":
        return TensorSpec(tuple(int(s) for s in t.shape), t.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        dtype = getattr(torch, self.dtype) if isinstance(self.dtype, str) else self.dtype
        return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Value:
    """A tensor one region makes and others use. `index` is its position in
    the producer's outputs; `differentiable` says whether a gradient flows back."""

    id: int
    producer: int
    index: int
    consumers: tuple[int, ...]
    spec: TensorSpec
    differentiable: bool


@dataclass(frozen=True)
class RegionInput:
    kind: str            # PARAM | BUFFER | BATCH | VALUE
    ref: str | int       # parameter/buffer name, batch input position, or value id


@dataclass
class Region:
    index: int
    tags: tuple[tuple[str, int], ...]
    inputs: tuple[RegionInput, ...]
    outputs: tuple[int, ...]             # value ids, in graph-output order
    loss: bool                           # the last output is the step's loss
    graph: fx.GraphModule | None = field(default=None, repr=False)
    source: str | None = None            # "file:line" of the region's first op
    # Ops outside every annotated region that joined this one: (op, why, "file:line").
    joined: tuple[tuple[str, str, str | None], ...] = ()

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(i.ref for i in self.inputs if i.kind == PARAM)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.tags)


@dataclass
class Program:
    regions: tuple[Region, ...]
    values: tuple[Value, ...]
    params: dict[str, TensorSpec]
    buffers: dict[str, TensorSpec]
    batch: tuple[TensorSpec, ...]        # microbatch-sized example inputs
    input_names: tuple[str, ...] = ()    # keyword names of the batch inputs, when forward took keywords
    constants: dict = field(default_factory=dict)   # tensors forward makes from data, sent as buffers
    annotated: bool = True               # False: the model has no piper.annotate regions (it is one, PP=0)
    undivided_experts: tuple[str, ...] = ()   # Hugging Face experts modules capture left as they are, and why
    tensor: object = None                # a `tensor_parallel.TensorLayout` when divided over tp

    def whole_shape(self, param: str) -> tuple[int, ...]:
        """A parameter's shape in the model (`params` holds one device's under tensor parallelism)."""
        if self.tensor is not None and param in self.tensor.shapes:
            return tuple(self.tensor.shapes[param])
        return tuple(self.params[param].shape)

    def owner(self, param: str) -> int:
        """The region that owns a parameter: the first one that uses it."""
        for region in self.regions:
            if param in region.params:
                return region.index
        raise KeyError(param)

    @staticmethod
    def chain(tags: dict[str, int] | str) -> "Program":
        """An abstract chain of regions (`--regions PP=8`) for checking without a model."""
        if isinstance(tags, str):
            name, _, count = tags.partition("=")
            tags = {name.strip(): int(count)}
        (name, count), = tags.items()
        if not 1 <= count <= MAX_REGIONS:
            raise error("value-out-of-range", f"an abstract chain of {name}={_count(count)} regions; it holds from 1 "
                        f"to {MAX_REGIONS:,}", hint=f"pass --regions {name}=N with N the model's region count")
        spec = TensorSpec((1,), "float32")   # a torch dtype's name: an abstract chain never loads torch
        values = tuple(Value(i, i, 0, (i + 1,), spec, True) for i in range(count - 1))
        regions = []
        for i in range(count):
            inputs = [RegionInput(PARAM, f"r{i}.weight")]
            inputs += [RegionInput(BATCH, 0)] if i == 0 else [RegionInput(VALUE, i - 1)]
            if i == count - 1:
                inputs.append(RegionInput(BATCH, 1))
            regions.append(Region(i, ((name, i),), tuple(inputs), (i,) if i < count - 1 else (), i == count - 1))
        params = {f"r{i}.weight": spec for i in range(count)}
        return Program(tuple(regions), values, params, {}, (spec, spec))


def op_schema(node) -> str | None:
    """The schema name of the op a graph node calls (`"piper::tp_copy"`, `"aten::view"`), or None."""
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None and node.op == "call_function" else None


def _stack_line(node: fx.Node) -> str | None:
    return last_user_frame(node.meta.get("stack_trace") or "")


def _mutation_error(model, name: str, node: fx.Node | None = None):
    """Forward updates a buffer or parameter: name the module and what to do instead."""
    module_name = name.rpartition(".")[0]
    try:
        module = model.get_submodule(module_name) if module_name else model
        kind = type(module).__name__
    except AttributeError:
        kind = "module"
    where = _stack_line(node) if node is not None else None
    norm = "BatchNorm" in kind
    return error("unsupported-model",
                 f"forward of {kind} `{module_name or 'the model'}` updates `{name}` in place"
                 + (f" (`{node.target}` at {where})" if where else "")
                 + (": BatchNorm's running statistics" if norm else ""),
                 notes=("Piper runs each region on several devices and microbatches; a buffer written in "
                        "forward would differ between them, so buffer updates are not supported yet",),
                 hint=(f"call `.eval()` on `{module_name}` before piper.compile to train with fixed statistics, "
                       "or use LayerNorm / GroupNorm instead of BatchNorm" if norm else
                       "move the update out of forward (do it between steps), or use LayerNorm instead of "
                       "BatchNorm"))
