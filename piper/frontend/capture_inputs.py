"""What each input of an exported forward is (parameter, buffer, batch input or a
constant), and the in-place updates of parameters and buffers capture refuses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .captured import BATCH, BUFFER, PARAM, RegionInput, TensorSpec, _mutation_error
from ..diagnostics import error
from ..lazy import LazyModule

torch = LazyModule("torch")
fx = LazyModule("torch.fx")


@dataclass
class GraphInputs:
    """The exported graph's placeholders, sorted by what they are."""
    kind_of: dict[str, RegionInput] = field(default_factory=dict)     # placeholder name -> what it is
    params: dict[str, TensorSpec] = field(default_factory=dict)
    buffers: dict[str, TensorSpec] = field(default_factory=dict)
    batch: list[TensorSpec] = field(default_factory=list)
    constant_inputs: dict[str, str] = field(default_factory=dict)     # placeholder name -> constant's name
    constants: dict = field(default_factory=dict)                     # values that travel as buffers


def read_inputs(exported) -> GraphInputs:
    """Sort the exported graph's inputs by the graph signature's kinds."""
    graph = exported.graph_module.graph
    found = GraphInputs()
    for spec in exported.graph_signature.input_specs:
        name = spec.arg.name
        kind = spec.kind.name
        node = next(n for n in graph.nodes if n.op == "placeholder" and n.name == name)
        if kind == "PARAMETER":
            found.kind_of[name] = RegionInput(PARAM, spec.target)
            found.params[spec.target] = TensorSpec.of(node.meta["val"])
        elif kind == "BUFFER":
            found.kind_of[name] = RegionInput(BUFFER, spec.target)
            found.buffers[spec.target] = TensorSpec.of(node.meta["val"])
        elif kind == "USER_INPUT":
            found.kind_of[name] = RegionInput(BATCH, len(found.batch))
            found.batch.append(TensorSpec.of(node.meta["val"]))
        elif kind == "CONSTANT_TENSOR" and (spec.target or "").rpartition(".")[2].startswith("lifted_tensor"):
            value = exported.constants.get(spec.target)
            if isinstance(value, torch.Tensor) and value.device.type != "meta" and value.numel():
                # Made in forward from Python data on the CPU (`torch.tensor(d ** 0.5)`): its value is
                # known, so it travels to the workers as a buffer would.
                found.kind_of[name] = RegionInput(BUFFER, spec.target)
                found.buffers[spec.target] = TensorSpec.of(value)
                found.constants[spec.target] = value.detach().clone()
            else:
                found.constant_inputs[name] = spec.target
        else:
            raise error("unsupported-model", f"forward uses a {kind.lower().replace('_', ' ')} (`{spec.target}`), "
                        "which Piper cannot place yet",
                        hint="make constant tensors buffers of the module (register_buffer)")
    return found


def check_in_place_updates(graph: fx.Graph, kind_of: dict[str, RegionInput], model) -> None:
    """Refuse a forward that updates a parameter or buffer in place."""
    for n in graph.nodes:
        # Export keeps in-place updates of parameters and buffers (BatchNorm statistics, counters) in the graph.
        schema = getattr(n.target, "_schema", None)
        if n.op == "call_function" and schema is not None and schema.is_mutable and n.args \
                and isinstance(n.args[0], fx.Node) and kind_of.get(n.args[0].name, RegionInput(BATCH, 0)).kind in (
                    PARAM, BUFFER):
            raise _mutation_error(model, kind_of[n.args[0].name].ref, n)
