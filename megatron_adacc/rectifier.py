"""The rectifier (paper: "Adaptive Policy Evolution") re-plans as activation statistics move.

Outlier channel counts move early in training and settle later, and the payloads of the
outlier-separated sites move with them. A plan made at iteration 0 goes stale. At each tracking
iteration (exponential backoff: 1, 2, 4, 8, ... up to a cap) the rectifier:
- samples the tracked sites' real tensors: one forward through the profiler's probes
  (``profiler.sample_sites``);
- measures outlier channels, payload bytes and reconstruction error with the real codecs;
- writes the payloads into the planner's costs, re-plans and decides whether to swap.
The trainer applies a swap with ``apply_plan`` between steps.

An outlier-separating codec keeps a fixed capacity of exact channels: the profile's largest outlier
count over the layers. Where tracking counts more outliers, it raises the site's capacity to the
count and swaps away a plan with the old capacity ("capacity").

Beyond the paper:
- a jump in a tracked site's compression rate resets the backoff to frequent tracking;
- an accuracy guard forbids compression at a site whose relative reconstruction error exceeds a
  threshold. The planner then retains or recomputes it; a guarded site stays guarded.

Encode and decode times stay the profile's. The step watch (step_watch.py) re-times them when a
plan's measured steps miss its prediction, and swaps through ``take``.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from megatron_adacc import planning, policies
from megatron_adacc.profiling import profiler
from megatron_adacc.common import sites as site_table
from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.plan import RETAIN_DECISION, Plan

DEFAULT_MAX_INTERVAL = 256
DEFAULT_RESET_FRACTION = 0.25
# int4 with a per-group scale max|x|/8 leaves a relative RMS error of ~0.09 on bell-shaped
# activations (groups of 64: max ~2.5 sigma, rounding RMS ~max/8/sqrt(12)); outlier
# separation keeps it there when a few channels are large. 0.2 is twice that: a site only
# crosses it when its values defeat the codec (spikes inside groups that no channel z-score
# catches, a codec twice as coarse), the same bound the runtime's gradient tests hold.
DEFAULT_GUARD_THRESHOLD = 0.2
# A swap must buy at least this fraction of the current plan's added time: equal-time plans
# (ties the planner breaks either way) are not worth a swap.
MIN_GAIN_FRACTION = 1e-6
# A swap made only to be faster must leave this fraction of the budget free. Batches move the
# outlier counts a little; a plan planned flush against the budget would otherwise be left
# for being over it at one tracking iteration and taken back at the next (seen in the demo).
FASTER_SWAP_HEADROOM = 0.01


def default_sites(costs: ModelCosts) -> tuple[str, ...]:
    """The outlier-separated sites (outputs of Linear, LayerNorm and GELU) these costs can compress.

    Their compression rates follow the outlier counts."""
    return tuple(site.name for site in costs.sites
                 if site.can_compress and site.name in site_table.SITES
                 and site_table.get(site.name).default_codec == site_table.OUTLIER_CODEC)


class TrackingSchedule:
    """Exponential backoff: tracking iterations 1, 2, 4, 8, ..., then every ``max_interval``.

    ``reset(iteration)`` starts over from there: iteration + 1, + 2, + 4, ..."""

    def __init__(self, max_interval: int = DEFAULT_MAX_INTERVAL):
        if max_interval < 1:
            raise ValueError(f"max_interval must be >= 1, got {max_interval}")
        self.max_interval = max_interval
        self.reset(0)

    def is_tracking(self, iteration: int) -> bool:
        return iteration >= self.next_iteration

    def tracked(self, iteration: int) -> None:
        """Record tracking at ``iteration``; the interval doubles (up to the cap)."""
        self.next_iteration = iteration + self.interval
        self.interval = min(2 * self.interval, self.max_interval)

    def reset(self, iteration: int) -> None:
        self.interval = 1
        self.next_iteration = iteration + 1


@dataclass(frozen=True)
class SiteStats:
    """One tracked site at one tracking iteration (one layer, the profiled micro-batch)."""

    codec: str
    payload_bytes: int                 # at `capacity` for an outlier-separating codec
    compression_rate: float            # payload / full bytes
    outlier_channels: int | None       # None for codecs without outlier separation
    channels: int
    error: float                       # ||x - decode(encode(x))|| / ||x||
    capacity: int | None = None        # exact channels the site's payload keeps from now on


def site_stats(sample: profiler.SiteSample, full_bytes: int,
               capacity: int | None = None) -> SiteStats:
    """Statistics of the tensors the runtime handed a site's codec, with that codec.

    Args:
        capacity: the site's capacity of exact outlier channels so far (outlier-separating codecs).
            It is raised to the tensors' largest outlier count where that is more. The payload is
            the one at the raised capacity; the error is the codec's at its own.
    """
    codec = sample.codec
    separates = getattr(codec, "separates_outliers", False)
    outliers, squared_error, squared_norm = 0, 0.0, 0.0
    payload_bytes = sample.payload_bytes
    for tensor in sample.tensors:
        payload = codec.encode(tensor)
        # Every outlier channel, whatever the capacity: a host sync, but tracking runs
        # between steps.
        if separates:
            outliers = max(outliers, int(codec.outlier_count(tensor)))
        exact = tensor.float()
        error = exact - codec.decode(payload).float()
        squared_error += error.square().sum(dtype=torch.float64).item()
        squared_norm += exact.square().sum(dtype=torch.float64).item()
    if separates:
        # Capacities never shrink: that would trade accuracy back for bytes on one batch's word.
        capacity = max(capacity or 0, outliers)
        # the ruler's bytes, moved from the sampled codec's capacity to the site's
        payload_bytes += sum(codec.payload_bytes(t.shape, t.dtype, min(capacity, _channels(t)))
                             - codec.payload_bytes(t.shape, t.dtype) for t in sample.tensors)
    last = sample.tensors[-1]
    return SiteStats(
        codec=codec.name,
        payload_bytes=payload_bytes,
        compression_rate=payload_bytes / full_bytes if full_bytes else 1.0,
        outlier_channels=outliers if separates else None,
        channels=_channels(last),
        error=math.sqrt(squared_error / squared_norm) if squared_norm else 0.0,
        capacity=capacity if separates else None,
    )


def _channels(tensor: torch.Tensor) -> int:
    return tensor.shape[-1] if tensor.dim() else 1


@dataclass
class PlanSwap:
    """A decided swap: what the trainer applies before the next forward."""

    old: planning.PlanResult
    new: planning.PlanResult
    # "faster", "over budget" or "guard"; the step watch's: "retimed", "measured slower"
    reason: str
    changed: list[dict]                # {site, layers, from, to}
    predicted_gain_s: float            # added time per step saved (< 0: forced, slower)

    def to_record(self) -> dict:
        return {"from": self.old.plan.plan_id, "to": self.new.plan.plan_id,
                "reason": self.reason, "changed": self.changed,
                "predicted_gain_s": self.predicted_gain_s}

    def describe(self, iteration: int, micro_batches: int = 1,
                 measured_gain_s: float | None = None) -> str:
        """The swap for a person: a head line, then a line per changed site and layer range.

        Args:
            micro_batches: a step's, which the predicted gain (per micro-batch) is scaled by.
            measured_gain_s: the step time the new plan measured faster by, where both ran."""
        gain, basis = ((measured_gain_s, "measured") if measured_gain_s is not None
                       else (micro_batches * self.predicted_gain_s, "predicted"))
        faster = "faster" if gain >= 0 else "slower"
        lines = [f"adacc: iteration {iteration}: plan {self.old.plan.plan_id} -> "
                 f"{self.new.plan.plan_id} ({self.reason}; {basis} {abs(gain) * 1e3:.3f} ms a "
                 f"step {faster})"]
        rows = [(c["site"], planning.layer_ranges(c["layers"]), c["from"], c["to"])
                for c in self.changed]
        widths = [max((len(row[column]) for row in rows), default=0) for column in range(3)]
        lines += [f"  {site:<{widths[0]}}  layers {layers:<{widths[1]}}  {was:<{widths[2]}} -> "
                  f"{now}" for site, layers, was, now in rows]
        return "\n".join(lines)


@dataclass
class Outcome:
    """What one tracking iteration found and decided."""

    iteration: int
    stats: dict[str, SiteStats]
    jumped: list[str] = field(default_factory=list)    # sites whose statistic jumped
    guarded: list[str] = field(default_factory=list)   # sites newly forbidden to compress
    swap: PlanSwap | None = None
    note: str = ""                                     # why not, when there is no swap
    infeasible: str = ""                               # set when the budget cannot be met
    tracking_time_s: float = 0.0

    def to_record(self) -> dict:
        record = {
            "tracking": True,
            "tracking_time_s": self.tracking_time_s,
            "outlier_channels": {name: s.outlier_channels for name, s in self.stats.items()},
            "outlier_capacity": {name: s.capacity for name, s in self.stats.items()},
            "compression_rate": {name: s.compression_rate for name, s in self.stats.items()},
            "reconstruction_error": {name: s.error for name, s in self.stats.items()},
        }
        if self.jumped:
            record["tracking_reset"] = self.jumped
        if self.guarded:
            record["guarded_sites"] = self.guarded
        if self.infeasible:
            record["budget_infeasible"] = self.infeasible
        if self.swap is not None:
            record["plan_swap"] = self.swap.to_record()
        elif self.note:
            record["plan_kept"] = self.note
        return record


class Rectifier:
    """Holds the current costs and plan; ``observe`` at tracking iterations."""

    def __init__(self, costs: ModelCosts, result: planning.PlanResult, budget_bytes: int, *,
                 policy: str = "auto", sites: Iterable[str] | None = None,
                 guard_threshold: float = DEFAULT_GUARD_THRESHOLD,
                 reset_fraction: float = DEFAULT_RESET_FRACTION,
                 max_interval: int = DEFAULT_MAX_INTERVAL,
                 allow_lossy_sources: bool = False, strict: bool = False):
        self.costs = costs          # every measured codec: ``policy`` picks its own
        self.result = result
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.sites = tuple(sites) if sites else default_sites(costs)
        unknown = [name for name in self.sites if name not in {s.name for s in costs.sites}]
        if unknown:
            raise ValueError(f"tracking sites {unknown} are not sites of this model; have "
                             f"{[s.name for s in costs.sites]}")
        self.guard_threshold = guard_threshold
        self.reset_fraction = reset_fraction
        self.allow_lossy_sources = allow_lossy_sources
        self.strict = strict
        self.schedule = TrackingSchedule(max_interval)
        self.guarded: set[str] = set()
        self.last_stats: dict[str, SiteStats] = {}
        self.tracking_time_s = 0.0
        self.swaps = 0

    # --- the tracking iteration ------------------------------------------------------------
    def observe(self, iteration: int, model: torch.nn.Module, batch: profiler.Batch,
                loss_fn: profiler.LossFn | None = None) -> Outcome:
        """Sample the tracked sites on ``batch`` and decide; call between steps.

        The sample is one forward, and the model is left as found."""
        started = time.perf_counter()
        outcome = self.update(iteration, _from_rank0(self.measure(model, batch, loss_fn)))
        outcome.tracking_time_s = time.perf_counter() - started
        self.tracking_time_s += outcome.tracking_time_s
        return outcome

    def measure(self, model: torch.nn.Module, batch: profiler.Batch,
                loss_fn: profiler.LossFn | None = None) -> dict[str, SiteStats]:
        samples = profiler.sample_sites(model, batch, self.sites, strict=self.strict,
                                        loss_fn=loss_fn)
        return {name: site_stats(sample, self.costs.site(name).bytes,
                                 _capacity(self.costs, name, sample.codec.name))
                for name, sample in samples.items()}

    def update(self, iteration: int, stats: Mapping[str, SiteStats]) -> Outcome:
        """The decision from fresh ``stats``: backoff, guard, re-plan, swap or keep.

        It touches no tensors."""
        outcome = Outcome(iteration, dict(stats))
        outcome.jumped = [name for name, now in stats.items()
                          if _jumped(self.last_stats.get(name), now, self.reset_fraction)]
        self.schedule.tracked(iteration)
        if outcome.jumped:
            self.schedule.reset(iteration)
        self.last_stats.update(stats)

        outcome.guarded = sorted(name for name, now in stats.items()
                                 if now.error > self.guard_threshold and name not in self.guarded)
        self.guarded.update(outcome.guarded)
        # Only payloads are refreshed: codec times hardly depend on the statistics, and
        # re-timing them here would cost time and make plans flap on noise.
        self.costs = refreshed_costs(self.costs, stats, self.guarded)

        try:
            new = policies.plan(self.policy, self.costs, self.budget_bytes,
                                allow_lossy_sources=self.allow_lossy_sources)
        except planning.InfeasibleBudget as exc:
            # Payloads grew past what the budget allows: the least-peak plan overruns it least.
            new = policies.plan(self.policy, self.costs, exc.minimum_budget,
                                allow_lossy_sources=self.allow_lossy_sources)
            outcome.infeasible = f"no plan fits the budget any more: {exc}"
        outcome.swap, outcome.note = self._compare(self.result, new)
        if outcome.swap is not None:
            self.result = new
            self.swaps += 1
        return outcome

    def _compare(self, current: planning.PlanResult, new: planning.PlanResult
                 ) -> tuple[PlanSwap | None, str]:
        if new.plan.plan_id == current.plan.plan_id:
            return None, "the plan is still optimal"
        try:
            layers = [planning.evaluate_layer(self.costs, decisions)
                      for decisions in current.layer_decisions]
        except ValueError:  # it compresses a site the guard now forbids
            layers = None
        # Both on the current costs (added_time_s): the step watch's re-timing may have changed
        # times since the current plan was made, where refreshing moves payloads only.
        current_s = (current.added_time_s if layers is None
                     else sum(layer.time_s for layer in layers))
        gain = current_s - new.added_time_s
        if below_capacity(current, self.costs):
            # more outlier channels than it keeps exact: a raised capacity keeps them
            return self._swap(current, new, "capacity", gain), ""
        if layers is None:
            return self._swap(current, new, "guard", gain), ""
        if planning.peak_bytes(self.costs, layers) > self.budget_bytes:
            return self._swap(current, new, "over budget", gain), ""
        if gain <= MIN_GAIN_FRACTION * current_s:
            return None, "another plan is optimal too, but no faster"
        if new.peak_bytes > (1 - FASTER_SWAP_HEADROOM) * self.budget_bytes:
            return None, "a faster plan exists, but too close to the budget to swap for"
        return self._swap(current, new, "faster", gain), ""

    def take(self, new: planning.PlanResult, reason: str) -> PlanSwap:
        """Swap to ``new`` for a ``reason`` decided elsewhere, such as the step watch's step times.

        The caller applies it before the next forward, as with the rectifier's own swaps."""
        # Priced on the costs ``new`` was planned on: after a re-timing, the current plan's own
        # added time is the one the re-timing showed wrong.
        swap = self._swap(self.result, new, reason,
                          added_time_s(self.costs, self.result) - added_time_s(self.costs, new))
        self.result = new
        self.swaps += 1
        return swap

    # --- resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a run resumed from a checkpoint needs to decide as this one would: plain data.

        The costs as tracking refreshed them, the plan in force, the backoff, the guarded sites
        and the last statistics (for jumps)."""
        return {"costs": self.costs.to_dict(), "plan": self.result.plan.to_dict(),
                "budget_bytes": self.budget_bytes, "policy": self.policy,
                "allow_lossy_sources": self.allow_lossy_sources,
                "interval": self.schedule.interval,
                "next_iteration": self.schedule.next_iteration, "guarded": sorted(self.guarded),
                "last_stats": {name: asdict(stats) for name, stats in self.last_stats.items()},
                "swaps": self.swaps}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from ``state_dict()`` of a run of the same model.

        Raises:
            ValueError: the state is another model's (its sites or layers differ), or was
                planned for another budget, policy or choice of rebuild sources."""
        costs = ModelCosts.from_dict(state["costs"])
        if ([site.name for site in costs.sites] != [site.name for site in self.costs.sites]
                or costs.num_layers != self.costs.num_layers):
            raise ValueError("the saved tracking state is another model's")
        planned = (state["budget_bytes"], state["policy"], state["allow_lossy_sources"])
        if planned != (self.budget_bytes, self.policy, self.allow_lossy_sources):
            raise ValueError(f"the saved tracking state was planned for budget {planned[0]} B, "
                             f"policy {planned[1]}, lossy sources {planned[2]}; this run's are "
                             f"{self.budget_bytes} B, {self.policy}, {self.allow_lossy_sources}")
        plan = Plan.from_dict(state["plan"])
        layers = [planning.evaluate_layer(costs, {site.name: plan.decision(layer, site.name)
                                                  for site in costs.sites})
                  for layer in range(costs.num_layers)]
        result = planning.PlanResult.from_layers(
            costs, layers, budget_bytes=self.result.budget_bytes, solve_time_s=0.0,
            minimum_feasible_budget=self.result.minimum_feasible_budget,
            per_layer=self.result.per_layer, allow_lossy_sources=self.allow_lossy_sources,
            method=self.result.method)
        if result.plan.plan_id != plan.plan_id:
            raise ValueError("the saved plan does not rebuild from the saved costs")
        self.costs, self.result = costs, result
        self.schedule.interval = int(state["interval"])
        self.schedule.next_iteration = int(state["next_iteration"])
        self.guarded = set(state["guarded"])
        self.last_stats = {name: SiteStats(**stats)
                           for name, stats in state["last_stats"].items()}
        self.swaps = int(state["swaps"])

    @staticmethod
    def _swap(current, new, reason, gain) -> PlanSwap:
        return PlanSwap(current, new, reason, changed_decisions(current, new), gain)


# --- helpers -------------------------------------------------------------------------------
def _jumped(before: SiteStats | None, now: SiteStats, fraction: float) -> bool:
    """Whether the site's compression rate moved by more than ``fraction`` of its previous value."""
    # The rate, not the outlier count, is what the planner sees. Early in training counts
    # move from a few channels to a few dozen while the payload moves by a fraction of that
    # (2 -> 17 outlier channels took a GELU site from 13.7% to 16.6% of its size on the demo
    # corpus); a reset at each such move kept tracking at every iteration or two.
    if before is None:
        return False
    return abs(now.compression_rate - before.compression_rate) > fraction * before.compression_rate


def refreshed_costs(costs: ModelCosts, stats: Mapping[str, SiteStats],
                    guarded: Iterable[str]) -> ModelCosts:
    """``costs`` with the sampled codecs' measured payloads, and no codec at the guarded sites.

    The planner then retains or recomputes the guarded sites."""
    guarded = set(guarded)
    sites = []
    for site in costs.sites:
        if site.name in guarded:
            site = replace(site, codecs=())
        elif site.name in stats:
            now = stats[site.name]
            site = replace(site, codecs=tuple(
                replace(codec, payload_bytes=now.payload_bytes,
                        capacity=now.capacity if now.capacity is not None else codec.capacity)
                if codec.codec == now.codec else codec for codec in site.codecs))
        sites.append(site)
    return replace(costs, sites=sites)


def _capacity(costs: ModelCosts, site: str, codec: str) -> int | None:
    """The capacity ``costs`` give ``codec`` at ``site`` (None: none, or no such entry)."""
    return next((c.capacity for c in costs.site(site).codecs if c.codec == codec), None)


def added_time_s(costs: ModelCosts, result: planning.PlanResult) -> float:
    """``result``'s added time per micro-batch priced on ``costs``.

    A plan using a codec ``costs`` no longer offer (the guard's) keeps the time it was planned
    with."""
    try:
        return sum(planning.evaluate_layer(costs, decisions).time_s
                   for decisions in result.layer_decisions)
    except ValueError:
        return result.added_time_s


def below_capacity(result: planning.PlanResult, costs: ModelCosts) -> bool:
    """Whether ``result`` keeps fewer exact outlier channels at a site than ``costs`` now give."""
    for decisions in result.layer_decisions:
        for site, decision in decisions.items():
            codec = decision.codec_for(site)
            wanted = _capacity(costs, site, codec) if codec is not None else None
            if wanted is not None and (decision.capacity or 0) < wanted:
                return True
    return False


def changed_decisions(old: planning.PlanResult, new: planning.PlanResult) -> list[dict]:
    """Every (site, old decision, new decision) that differs, with the layers it covers."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for layer, (before, after) in enumerate(zip(old.layer_decisions, new.layer_decisions)):
        for site in sorted(set(before) | set(after)):
            was, now = before.get(site, RETAIN_DECISION), after.get(site, RETAIN_DECISION)
            if was != now:
                groups.setdefault((site, _label(site, was), _label(site, now)), []).append(layer)
    return [{"site": site, "layers": layers, "from": was, "to": now}
            for (site, was, now), layers in groups.items()]


def _label(site: str, decision) -> str:
    codec = decision.codec_for(site)
    label = decision.action if codec is None else f"{decision.action}:{codec}"
    return label if decision.capacity is None else f"{label}@{decision.capacity}"


def _from_rank0(stats: dict[str, SiteStats]) -> dict[str, SiteStats]:
    """Rank 0's statistics on every rank.

    Ranks see different data (and tensor-parallel shards), yet must make the same decisions and
    track at the same iterations."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stats
    box = [{name: asdict(s) for name, s in stats.items()}]
    dist.broadcast_object_list(box, src=0)
    return {name: SiteStats(**s) for name, s in box[0].items()}
