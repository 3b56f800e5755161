"""A Plan: for every layer and site, retain, compress (with which codec) or recompute.

Plain data. It round-trips through YAML in the form users write by hand:

    sites: {ln1_out: recompute, gelu_in: compress, gelu_out: recompute}   # every layer
    layers:                                                                # overrides
      "0-3": {sites: {gelu_in: {action: compress, codec: sym_int4}}}

- Layers are numbered from 0 across the whole model (megatron's 1-based ``layer_number`` - 1).
- A site the plan does not name is retained.
- ``compress`` without a codec means the site's default codec (sites.SITES).
- An outlier-separating codec (outlier_int4) may take a ``capacity``: how many outlier channels its
  payload keeps exact. The planner writes the profile's count there, so the runtime keeps the bytes
  it planned:

    sites: {ln1_out: {action: compress, codec: outlier_int4, capacity: 12}}
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from megatron_adacc.common import sites as site_table
from megatron_adacc.common.sites import ACTIONS, COMPRESS, RECOMPUTE, RETAIN


class PlanError(ValueError):
    """A plan that cannot be applied; the message names the bad key and the valid choices."""


def _codec_names() -> tuple[str, ...]:
    from megatron_adacc import codecs

    return tuple(codecs.NAMES)


@dataclass(frozen=True)
class Decision:
    action: str
    codec: str | None = None
    capacity: int | None = None  # outlier channels kept exact (outlier-separating codecs)

    def codec_for(self, site: str) -> str | None:
        """The codec actually used at ``site`` (None unless compressing)."""
        if self.action != COMPRESS:
            return None
        return self.codec or site_table.get(site).default_codec

    def to_yaml_value(self) -> Any:
        if self.codec is None and self.capacity is None:
            return self.action
        value = {"action": self.action}
        if self.codec is not None:
            value["codec"] = self.codec
        if self.capacity is not None:
            value["capacity"] = self.capacity
        return value

    def codec_options(self) -> dict[str, Any]:
        """The keywords the codec is built with (codecs.get) besides its name."""
        return {} if self.capacity is None else {"capacity": self.capacity}


RETAIN_DECISION = Decision(RETAIN)


def _parse_decision(where: str, site: str, value: Any) -> Decision:
    capacity = None
    if isinstance(value, str):
        action, codec = value, None
    elif isinstance(value, Mapping):
        unknown = set(value) - {"action", "codec", "capacity"}
        if unknown:
            raise PlanError(
                f"{where}.{site}: unknown key(s) {sorted(unknown)}; valid keys: action, codec, "
                "capacity"
            )
        if "action" not in value:
            raise PlanError(f"{where}.{site}: missing 'action' (one of {', '.join(ACTIONS)})")
        action, codec, capacity = value["action"], value.get("codec"), value.get("capacity")
    else:
        raise PlanError(
            f"{where}.{site}: expected an action ({', '.join(ACTIONS)}) or "
            f"{{action: ..., codec: ...}}, got {value!r}"
        )
    return check_decision(where, site, Decision(action, codec, capacity))


def check_decision(where: str, site: str, decision: Decision) -> Decision:
    """``decision`` if ``site`` can take it, else a PlanError naming ``where``.

    This is the one rule for plan files and the runtime's layers. A codec must be able to hold
    the site's tensor: never the bitmask codec for a floating-point value."""
    action, codec = decision.action, decision.codec
    if site not in site_table.SITES:
        raise PlanError(
            f"{where}: unknown site {site!r}; valid sites: {', '.join(site_table.SITE_NAMES)}"
        )
    if action not in ACTIONS:
        raise PlanError(
            f"{where}.{site}: unknown action {action!r}; valid actions: {', '.join(ACTIONS)}"
        )
    if codec is not None:
        if action != COMPRESS:
            raise PlanError(f"{where}.{site}: a codec only applies to action 'compress'")
        if codec not in _codec_names():
            raise PlanError(
                f"{where}.{site}: unknown codec {codec!r}; valid codecs: "
                f"{', '.join(_codec_names())}"
            )
    if action == COMPRESS and site_table.get(site).default_codec is None:
        raise PlanError(f"{where}.{site}: {site} is never compressed; choose retain or "
                        f"recompute")
    if codec is not None and not site_table.get(site).takes(codec):
        fitting = [name for name in _codec_names() if site_table.get(site).takes(name)]
        raise PlanError(f"{where}.{site}: codec {codec!r} cannot hold {site} "
                        f"({site_table.get(site).description}); codecs for it: "
                        f"{', '.join(fitting)}")
    if decision.capacity is not None:
        if isinstance(decision.capacity, bool) or not isinstance(decision.capacity, int) \
                or decision.capacity < 0:
            raise PlanError(f"{where}.{site}: capacity must be a whole number >= 0, got "
                            f"{decision.capacity!r}")
        if action != COMPRESS or decision.codec_for(site) != site_table.OUTLIER_CODEC:
            raise PlanError(f"{where}.{site}: a capacity only applies to compress with "
                            f"{site_table.OUTLIER_CODEC}")
    if action == RECOMPUTE and not site_table.get(site).recomputable:
        raise PlanError(
            f"{where}.{site}: {site} cannot be recomputed ({site_table.get(site).description}); "
            f"choose retain" + (" or compress" if site_table.get(site).default_codec else "")
        )
    return decision


def _parse_sites(where: str, value: Any) -> dict[str, Decision]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PlanError(f"{where}: expected a mapping of site -> action, got {value!r}")
    return {site: _parse_decision(where, site, v) for site, v in value.items()}


def _parse_layer_range(key: Any) -> tuple[int, int]:
    text = str(key).strip()
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-", 1))
        else:
            first = last = int(text)
    except ValueError:
        raise PlanError(
            f"layers: bad layer range {key!r}; write a layer number '5' or a range '0-3'"
        ) from None
    if first < 0 or last < first:
        raise PlanError(f"layers: bad layer range {key!r}; need 0 <= first <= last")
    return first, last


def _format_range(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


@dataclass
class Plan:
    sites: dict[str, Decision] = field(default_factory=dict)
    layers: dict[tuple[int, int], dict[str, Decision]] = field(default_factory=dict)

    # --- queries -------------------------------------------------------------------------
    def decision(self, layer: int, site: str) -> Decision:
        for (first, last), overrides in self.layers.items():
            if first <= layer <= last and site in overrides:
                return overrides[site]
        return self.sites.get(site, RETAIN_DECISION)

    def for_layer(self, layer: int) -> dict[str, Decision]:
        """Every site's decision for ``layer`` (sites the plan does not name: retain)."""
        return {site: self.decision(layer, site) for site in site_table.SITE_NAMES}

    def validate_layers(self, num_layers: int) -> None:
        for first, last in self.layers:
            if last >= num_layers:
                raise PlanError(
                    f"layers: range {_format_range(first, last)!r} is outside the model's "
                    f"{num_layers} layers (0-{num_layers - 1})"
                )

    def shifted(self, offset: int) -> "Plan":
        """This plan with its layer ranges moved up by ``offset``.

        It turns a pipeline stage's plan, its layers numbered from 0, into the whole model's
        numbering, where the stage's first layer is layer ``offset``."""
        return Plan(dict(self.sites), {(first + offset, last + offset): dict(overrides)
                                       for (first, last), overrides in self.layers.items()})

    @functools.cached_property
    def plan_id(self) -> str:
        """A short content hash: equal plans share it.

        Hashed once: a Plan is not changed once made (``shifted`` and the planner make new
        ones), and the loop asks for it several times a step."""
        canonical = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha1(canonical.encode()).hexdigest()[:12]

    # --- construction --------------------------------------------------------------------
    @classmethod
    def uniform(cls, decisions: Mapping[str, Decision | str]) -> "Plan":
        return cls.from_dict({"sites": {s: _as_value(d) for s, d in decisions.items()}})

    @classmethod
    def from_layers(cls, per_layer: Iterable[Mapping[str, Decision]]) -> "Plan":
        """The compact plan for an explicit per-layer list.

        The most common layer policy becomes the default, and runs of other layers become range
        overrides."""
        policies = [
            {s: d for s, d in layer.items() if d != RETAIN_DECISION} for layer in per_layer
        ]
        if not policies:
            return cls()
        keys = [tuple(sorted(p.items(), key=lambda kv: kv[0])) for p in policies]
        # Ties go to the lowest layer's policy: iterating a set would make the compact form
        # (and the plan_id) depend on the process's hash seed, so ranks would disagree.
        default_key = max(keys, key=keys.count)
        default = dict(default_key)
        layers: dict[tuple[int, int], dict[str, Decision]] = {}
        start = 0
        for index in range(1, len(keys) + 1):
            if index == len(keys) or keys[index] != keys[start]:
                if keys[start] != default_key:
                    full = {s: RETAIN_DECISION for s in default}
                    full.update(policies[start])
                    layers[(start, index - 1)] = {
                        s: d for s, d in full.items() if default.get(s, RETAIN_DECISION) != d
                    }
                start = index
        return cls(sites=default, layers=layers)

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan is a mapping with keys 'sites' and 'layers', got {data!r}")
        unknown = set(data) - {"sites", "layers"}
        if unknown:
            raise PlanError(f"unknown plan key(s) {sorted(unknown)}; valid keys: sites, layers")
        default = _parse_sites("sites", data.get("sites"))
        layers: dict[tuple[int, int], dict[str, Decision]] = {}
        raw_layers = data.get("layers") or {}
        if not isinstance(raw_layers, Mapping):
            raise PlanError("layers: expected a mapping of layer range -> {sites: ...}")
        for key, body in raw_layers.items():
            span = _parse_layer_range(key)
            for other in layers:
                if span[0] <= other[1] and other[0] <= span[1]:
                    raise PlanError(
                        f"layers: range {key!r} overlaps {_format_range(*other)!r}; "
                        f"each layer may be overridden once"
                    )
            where = f"layers.{key}"
            if not isinstance(body, Mapping) or set(body) - {"sites"}:
                raise PlanError(f"{where}: expected {{sites: {{site: action, ...}}}}")
            layers[span] = _parse_sites(f"{where}.sites", body.get("sites"))
        return cls(sites=default, layers=layers)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"sites": {s: d.to_yaml_value() for s, d in self.sites.items()}}
        if self.layers:
            data["layers"] = {
                _format_range(*span): {"sites": {s: d.to_yaml_value() for s, d in o.items()}}
                for span, o in sorted(self.layers.items())
            }
        return data

    # --- YAML ----------------------------------------------------------------------------
    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @classmethod
    def from_yaml(cls, text: str) -> "Plan":
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise PlanError(f"not valid YAML ({problem}{where})") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {str(path)!r} does not exist")
        try:
            return cls.from_yaml(path.read_text())
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def _as_value(decision: Decision | str) -> Any:
    return decision.to_yaml_value() if isinstance(decision, Decision) else decision
