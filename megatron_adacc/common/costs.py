"""The planner's input: what each site of one layer costs to keep, compress or rebuild.

It also holds the memory no plan changes. It is plain data, serialisable to a dict / JSON so the
ProfileDB can store it. Two producers fill it: the profiler (measured on this machine) and
``analytic.analytic_costs`` (a roofline model of a named accelerator). The planner reads nothing
else.

Units: bytes are integers and times are seconds, all at ``micro_batch_size`` for ONE layer. Every
layer is assumed to cost the same; the profiler and the analytic model both produce that.

A ``ModelCosts`` describes one pipeline stage: its layers, what it holds besides them, and how many
micro-batches it keeps in flight (``planning.model`` states the peak rule). Without pipeline
parallelism the one stage is the whole model.

A recomputed site is rebuilt one of two ways (sites.REBUILDS says which):
- by an operator (``operators``): one of megatron's submodules, run once per layer backward.
  ``Operator.rebuild_s`` is that call's own time.
- by re-running its forward segment (``segments``) from the start up to the site.
  ``SiteCost.rebuild_s`` is that time: the rebuild's cost when the site is the deepest recomputed
  one of its segment.
planning.rebuild_charges turns these into a layer's rebuild time (docs/memory-model.md).

``hooked_layer_s`` is what the runtime's hooks add to a step, once per layer with any action. The
hooks are a pack and an unpack call per saved tensor and a pre- and post-hook per submodule.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

from megatron_adacc.common import sites as site_table

# 2: rebuild_s from the segment start and segments replace per-op recompute_s and sources.
# 3: allocator_overhead_bytes. 4: operator-level rebuilds (operators, SiteCost.operator).
# 5: hooked_layer_s. 6: optimizer_step_bytes. 7: CodecCost.capacity.
# 8: persistent_overhead_bytes.
FORMAT_VERSION = 8


class CostsError(ValueError):
    """Inconsistent cost data; the message names the site and field."""


@dataclass(frozen=True)
class CodecCost:
    """One candidate codec for a site."""

    codec: str
    payload_bytes: int      # what stays in memory between forward and backward
    encode_s: float         # compress once in forward
    decode_s: float         # decompress once in backward
    # The exact channels an outlier-separating codec keeps (OutlierInt4's capacity): the
    # payload is sized at it, and the runtime's codec is built with it. None for the others.
    capacity: int | None = None


@dataclass(frozen=True)
class Segment:
    """A stretch of the layer's forward that the runtime re-runs to rebuild sites."""

    name: str
    start: str     # the site whose saved value the re-run starts from


# megatron-core's layer (see sites.SEGMENTS).
MEGATRON_SEGMENTS = tuple(Segment(name, start) for name, start in site_table.SEGMENTS.items())


@dataclass(frozen=True)
class Operator:
    """An operator-level rebuild (sites.Rebuild): the sites it reads and its own time."""

    name: str                    # sites.Rebuild.call
    sources: tuple[str, ...]
    rebuild_s: float = 0.0


@dataclass(frozen=True)
class SiteCost:
    """One site of one layer at the profiled micro-batch."""

    name: str
    bytes: int                       # full size as saved by autograd
    dtype: str                       # e.g. "bfloat16", "bool"
    # Re-running its segment from the start until this site is saved again.
    rebuild_s: float = 0.0
    segment: str | None = None       # None: no segment re-run rebuilds it
    codecs: tuple[CodecCost, ...] = ()
    # None: take it from the site table (unknown sites are never recomputed).
    recomputable: bool | None = None
    # The operator (ModelCosts.operators) that rebuilds it; it then has no segment.
    operator: str | None = None

    @property
    def can_recompute(self) -> bool:
        known = site_table.SITES.get(self.name)
        table_allows = (known is not None and known.recomputable
                        and (self.segment is not None or self.operator is not None))
        return table_allows if self.recomputable is None else (self.recomputable and table_allows)

    @property
    def can_compress(self) -> bool:
        # An unknown site (the profiler found something the table does not name) is retained:
        # no codec has been chosen for its kind of tensor.
        return self.name in site_table.SITES and bool(self.codecs)


def segment_run_s(sites: Iterable[SiteCost], segment: str) -> float:
    """Re-running ``segment`` whole: the rebuild of its last save."""
    return max((site.rebuild_s for site in sites if site.segment == segment), default=0.0)


@dataclass
class ModelCosts:
    """Everything the planner needs about one model at one micro-batch."""

    sites: list[SiteCost]
    num_layers: int
    static_bytes: int                 # parameters + gradients + optimizer states
    # Non-layer activations freed before the layers backprop: final norm, output layer,
    # logits, loss (the last stage's). The profiler counts the embedding's here too.
    non_layer_bytes: int
    backward_workspace_bytes: int     # gradients alive while one layer backprops, any plan
    micro_batch_size: int
    # How far the CUDA allocator's allocated peak of an all-retain forward and backward exceeded
    # the peak this model predicts (kernels' workspaces, working sets it leaves out); 0 on a CPU.
    # The optimizer step, after them, does not hold it.
    allocator_overhead_bytes: int = 0
    # What a model's first step leaves allocated for every later one, the optimizer step's
    # included: cuBLAS's workspaces, megatron's global memory buffer (unfused attention's
    # baddbmm input); 0 on a CPU.
    persistent_overhead_bytes: int = 0
    # What the optimizer step adds to static while no activations are alive: megatron's fp16
    # optimizer copies every 16-bit gradient to fp32 in its step and drops the copies at the
    # next zero_grad, before the forward; torch's foreach AdamW adds its workspace.
    optimizer_step_bytes: int = 0
    segments: tuple[Segment, ...] = MEGATRON_SEGMENTS
    # The operator-level rebuilds, in the order the runtime runs them (sites.REBUILDS).
    operators: tuple[Operator, ...] = ()
    # Of non_layer_bytes, what the layers' backward does not free: the shared sites, one
    # storage for the stage alive through every layer's backward (megatron's cached causal
    # mask; RoPE's cos and sin, freed with the stage's first layer's graph).
    held_non_layer_bytes: int = 0
    # Micro-batches whose activations the stage holds at once (1F1B: min(P - s, M)).
    in_flight_micro_batches: int = 1
    # Non-layer activations a micro-batch holds until its backward ends: the embedding's (the
    # first stage's); its backward runs after every layer's.
    embedding_bytes: int = 0
    # The stage input received from the previous stage, alive (the last micro-batch backprop
    # holding it) through the next micro-batch's forward: stages after the first whose 1F1B
    # runs a forward after a backward (planning.stage_costs says which).
    received_input_bytes: int = 0
    # What running one layer under the runtime's hooks adds to a step (module docstring).
    hooked_layer_s: float = 0.0
    # Free-form provenance: model shape, device or accelerator, dtype, who produced it.
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def operator(self, name: str) -> Operator:
        for operator in self.operators:
            if operator.name == name:
                return operator
        raise KeyError(f"no operator {name!r} in these costs")

    def site(self, name: str) -> SiteCost:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(f"no site {name!r} in these costs; have {[s.name for s in self.sites]}")

    @property
    def layer_bytes(self) -> int:
        """Bytes one layer saves with no optimisation."""
        return sum(site.bytes for site in self.sites)

    def validate(self) -> None:
        names = [site.name for site in self.sites]
        if len(set(names)) != len(names):
            raise CostsError(f"duplicate site names in {names}")
        if self.num_layers < 1:
            raise CostsError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.in_flight_micro_batches < 1:
            raise CostsError(f"in_flight_micro_batches must be >= 1, got "
                             f"{self.in_flight_micro_batches}")
        for number, label in ((self.static_bytes, "static_bytes"),
                              (self.non_layer_bytes, "non_layer_bytes"),
                              (self.embedding_bytes, "embedding_bytes"),
                              (self.received_input_bytes, "received_input_bytes"),
                              (self.backward_workspace_bytes, "backward_workspace_bytes"),
                              (self.allocator_overhead_bytes, "allocator_overhead_bytes"),
                              (self.persistent_overhead_bytes, "persistent_overhead_bytes"),
                              (self.optimizer_step_bytes, "optimizer_step_bytes"),
                              (self.held_non_layer_bytes, "held_non_layer_bytes")):
            if number < 0:
                raise CostsError(f"{label} must be >= 0, got {number}")
        if self.hooked_layer_s < 0:
            raise CostsError(f"hooked_layer_s must be >= 0, got {self.hooked_layer_s}")
        if self.held_non_layer_bytes > self.non_layer_bytes:
            raise CostsError(f"held_non_layer_bytes {self.held_non_layer_bytes} exceeds "
                             f"non_layer_bytes {self.non_layer_bytes}")
        order = [segment.name for segment in self.segments]
        if len(set(order)) != len(order):
            raise CostsError(f"duplicate segment names in {order}")
        segment_of = {site.name: site.segment for site in self.sites}
        for index, segment in enumerate(self.segments):
            # A re-run must start from something saved before it: a start inside its own
            # segment or a later one could itself be waiting for this re-run. A start that is
            # no site of these costs is kept by something the plan does not decide.
            start_segment = segment_of.get(segment.start)
            if start_segment is not None and order.index(start_segment) >= index:
                raise CostsError(f"segment {segment.name} starts from {segment.start}, which "
                                 f"is rebuilt by the same or a later segment")
            # Such a start is what the earlier segment's re-run ends with: its last save.
            if start_segment is not None and segment_run_s(self.sites, start_segment) > next(
                    site.rebuild_s for site in self.sites if site.name == segment.start):
                raise CostsError(f"segment {segment.name} starts from {segment.start}, which "
                                 f"segment {start_segment} rebuilds before its last save")
        products: dict[str, int] = {}   # site -> index of the operator rebuilding it
        for site in self.sites:
            if site.operator is not None:
                if site.segment is not None:
                    raise CostsError(f"site {site.name}: rebuilt by operator {site.operator} "
                                     f"and by segment {site.segment}")
                index = next((i for i, op in enumerate(self.operators)
                              if op.name == site.operator), None)
                if index is None:
                    raise CostsError(f"site {site.name}: operator {site.operator!r} is not one "
                                     f"of {[op.name for op in self.operators]}")
                products[site.name] = index
        for index, segment in enumerate(self.segments):
            # A re-run from a start an operator rebuilds follows that operator (the MLP's from
            # ln2_in), so the operator cannot read what the re-run rebuilds.
            rebuilt_by = products.get(segment.start)
            for source in self.operators[rebuilt_by].sources if rebuilt_by is not None else ():
                if segment_of.get(source) in order[index:]:
                    raise CostsError(f"segment {segment.name} starts from {segment.start}, "
                                     f"which operator {self.operators[rebuilt_by].name} "
                                     f"rebuilds from {source}, which the same or a later "
                                     "segment rebuilds")
        for index, operator in enumerate(self.operators):
            if operator.rebuild_s < 0:
                raise CostsError(f"operator {operator.name}: rebuild_s must be >= 0")
            for source in operator.sources:
                # Operators run in order: a source another operator rebuilds must be rebuilt
                # by an earlier one.
                if products.get(source, -1) >= index:
                    raise CostsError(f"operator {operator.name} reads {source}, which the same "
                                     f"or a later operator rebuilds")
        for site in self.sites:
            if site.bytes < 0 or site.rebuild_s < 0:
                raise CostsError(f"site {site.name}: bytes and rebuild_s must be >= 0")
            if site.segment is not None and site.segment not in order:
                raise CostsError(f"site {site.name}: segment {site.segment!r} is not one of "
                                 f"{order}")
            for codec in site.codecs:
                if codec.payload_bytes < 0 or codec.encode_s < 0 or codec.decode_s < 0:
                    raise CostsError(f"site {site.name}, codec {codec.codec}: negative cost")
                if codec.capacity is not None and codec.capacity < 0:
                    raise CostsError(f"site {site.name}, codec {codec.codec}: negative capacity")

    # --- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format_version"] = FORMAT_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelCosts":
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise CostsError(f"costs format version {version}; this planner reads {FORMAT_VERSION}")
        sites = [
            SiteCost(
                name=s["name"],
                bytes=int(s["bytes"]),
                dtype=s["dtype"],
                rebuild_s=float(s["rebuild_s"]),
                segment=s["segment"],
                codecs=tuple(CodecCost(**c) for c in s.get("codecs", ())),
                recomputable=s.get("recomputable"),
                operator=s.get("operator"),
            )
            for s in data["sites"]
        ]
        return cls(
            sites=sites,
            num_layers=int(data["num_layers"]),
            static_bytes=int(data["static_bytes"]),
            non_layer_bytes=int(data["non_layer_bytes"]),
            backward_workspace_bytes=int(data["backward_workspace_bytes"]),
            micro_batch_size=int(data["micro_batch_size"]),
            allocator_overhead_bytes=int(data["allocator_overhead_bytes"]),
            persistent_overhead_bytes=int(data["persistent_overhead_bytes"]),
            optimizer_step_bytes=int(data["optimizer_step_bytes"]),
            segments=tuple(Segment(**segment) for segment in data["segments"]),
            operators=tuple(Operator(name=op["name"], sources=tuple(op["sources"]),
                                     rebuild_s=float(op["rebuild_s"]))
                            for op in data.get("operators", ())),
            in_flight_micro_batches=int(data.get("in_flight_micro_batches", 1)),
            embedding_bytes=int(data.get("embedding_bytes", 0)),
            received_input_bytes=int(data.get("received_input_bytes", 0)),
            held_non_layer_bytes=int(data.get("held_non_layer_bytes", 0)),
            hooked_layer_s=float(data["hooked_layer_s"]),
            meta=dict(data.get("meta", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelCosts":
        return cls.from_dict(json.loads(text))
