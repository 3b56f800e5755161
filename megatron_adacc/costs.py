"""The planner's input: what every site of one transformer layer costs to keep, compress or
rebuild, plus the memory that no plan changes.

Plain data, serialisable to a dict / JSON so the ProfileDB can store it. Two producers fill it:
the profiler (measured on this machine) and ``hardware.analytic_costs`` (a roofline model of a
named accelerator). The planner reads nothing else.

Units: bytes are integers, times are seconds, all at ``micro_batch_size`` for ONE layer (every
layer is assumed to cost the same; a profiler measuring one layer and the analytic model both
produce that).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from megatron_adacc import sites as site_table

FORMAT_VERSION = 1


class CostsError(ValueError):
    """Inconsistent cost data; the message names the site and field."""


@dataclass(frozen=True)
class CodecCost:
    """One candidate codec for a site."""

    codec: str
    payload_bytes: int      # what stays in memory between forward and backward
    encode_s: float         # compress once in forward
    decode_s: float         # decompress once in backward


@dataclass(frozen=True)
class SiteCost:
    """One site of one layer at the profiled micro-batch."""

    name: str
    bytes: int                       # full size as saved by autograd
    dtype: str                       # e.g. "bfloat16", "bool"
    recompute_s: float               # time of the producing op, run once
    sources: tuple[str, ...] = ()    # sites the producing op reads (rebuild chain, exactness)
    codecs: tuple[CodecCost, ...] = ()
    # None: take it from the site table (unknown sites are never recomputed).
    recomputable: bool | None = None

    @property
    def can_recompute(self) -> bool:
        known = site_table.SITES.get(self.name)
        table_allows = known is not None and known.recomputable
        return table_allows if self.recomputable is None else (self.recomputable and table_allows)

    @property
    def can_compress(self) -> bool:
        # An unknown site (the profiler found something the table does not name) is retained:
        # no codec has been chosen for its kind of tensor.
        return self.name in site_table.SITES and bool(self.codecs)


@dataclass
class ModelCosts:
    """Everything the planner needs about one model at one micro-batch."""

    sites: list[SiteCost]
    num_layers: int
    static_bytes: int                 # parameters + gradients + optimizer states
    non_layer_bytes: int              # embedding output, final norm, logits, loss tensors
    backward_workspace_bytes: int     # gradients alive while one layer backprops, any plan
    micro_batch_size: int
    # Free-form provenance: model shape, device or accelerator, dtype, who produced it.
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

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
        for number, label in ((self.static_bytes, "static_bytes"),
                              (self.non_layer_bytes, "non_layer_bytes"),
                              (self.backward_workspace_bytes, "backward_workspace_bytes")):
            if number < 0:
                raise CostsError(f"{label} must be >= 0, got {number}")
        for site in self.sites:
            if site.bytes < 0 or site.recompute_s < 0:
                raise CostsError(f"site {site.name}: bytes and recompute_s must be >= 0")
            for source in site.sources:
                if source not in names:
                    raise CostsError(
                        f"site {site.name}: source {source!r} is not a site of these costs"
                    )
            for codec in site.codecs:
                if codec.payload_bytes < 0 or codec.encode_s < 0 or codec.decode_s < 0:
                    raise CostsError(f"site {site.name}, codec {codec.codec}: negative cost")
        self._check_acyclic()

    def _check_acyclic(self) -> None:
        # A rebuild chain must end at something kept: a cycle of recomputable sites would let
        # the planner drop all of them.
        sources = {site.name: site.sources for site in self.sites}
        done: set[str] = set()

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in path:
                raise CostsError(f"source cycle: {' -> '.join(path + (name,))}")
            if name in done:
                return
            for source in sources[name]:
                visit(source, path + (name,))
            done.add(name)

        for name in sources:
            visit(name, ())

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
                recompute_s=float(s["recompute_s"]),
                sources=tuple(s.get("sources", ())),
                codecs=tuple(CodecCost(**c) for c in s.get("codecs", ())),
                recomputable=s.get("recomputable"),
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
            meta=dict(data.get("meta", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelCosts":
        return cls.from_dict(json.loads(text))
