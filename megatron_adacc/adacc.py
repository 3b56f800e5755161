"""``Adacc``: the one public entry point; it runs Adacc's whole lifecycle in a megatron-core loop.

    from megatron_adacc import Adacc, AdaccConfig

    adacc = Adacc(AdaccConfig(policy="auto", memory_budget="2GiB"))
    model = GPTModel(config, adacc.layer_spec(), ...)         # megatron-core's local spec
    adacc.setup(model, (tokens, labels, loss_mask))           # profile or ProfileDB, plan, apply
    for iteration in range(1, iters + 1):
        with adacc.measure(iteration == 1):                   # every step; the ruler now and then
            loss = loss_fn(model, batch); loss.backward()
        optimizer.step()
        record = {**adacc.after_step(iteration, batch), **adacc.metrics()}

- ``setup`` runs once. It resolves the policy, applies it to every Adacc layer and prints the plan
  table on rank 0. ``auto`` profiles one step (or reuses its ProfileDB row) and plans.
- ``after_step`` acts only on tracking iterations and every few steps. On the first, the rectifier
  samples the activations and swaps in a better plan before the next forward. On the second, the
  step watch compares the timed steps with the plan's prediction.
- Every rank builds the same plan. Rank 0's profile is broadcast and the planner is deterministic.
  The rectifier's statistics and the step watch's times are rank 0's.

The current plan has one holder: the rectifier while it tracks, else the resolved policy.
"""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megatron_adacc import planning, policies
from megatron_adacc import step_watch as watching
from megatron_adacc.profiling import allocator, clock, engine_memory
from megatron_adacc.profiling import profiler
from megatron_adacc.models.attention import DEFAULT_SPEC_BACKEND, local_layer_spec
from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.errors import InputError
from megatron_adacc.codecs import BACKENDS
from megatron_adacc.common.plan import Plan, PlanError
from megatron_adacc.profiling.profile_db import ProfileDB
from megatron_adacc.rectifier import (DEFAULT_GUARD_THRESHOLD, DEFAULT_MAX_INTERVAL,
                                      DEFAULT_RESET_FRACTION, Rectifier)
from megatron_adacc.runtime import ActivationRuler, apply_plan, get_adacc_layer_spec
from megatron_adacc.common.sites import SITE_NAMES
from megatron_adacc.common.units import parse_size

TRACKING_MODES = ("backoff", "off")
STEP_WATCH_MODES = ("on", "off")
LossFn = Callable[[torch.nn.Module, profiler.Batch], torch.Tensor]


@dataclass(frozen=True)
class AdaccConfig:
    """Plain data: what ``--adacc-*`` flags (or a YAML config) say."""

    policy: str = "none"                 # none | auto | auto-no-outlier | full-recompute |
    #                                      quantize | a plan YAML file (see policies.py)
    memory_budget: int | str | None = None   # bytes or "12GiB"; auto needs one on a CPU
    tracking: str | None = None          # backoff | off; None: backoff with auto
    tracking_sites: tuple[str, ...] | None = None
    step_watch: str | None = None        # on | off; None: on while tracking (step_watch.py)
    tracking_max_interval: int = DEFAULT_MAX_INTERVAL
    tracking_reset_fraction: float = DEFAULT_RESET_FRACTION
    guard_threshold: float = DEFAULT_GUARD_THRESHOLD
    profile_db: str | None = None        # None: $ADACC_DATA_DIR/profiles.sqlite
    reprofile: bool = False
    profile_repeats: int | None = None   # None: the profiler's DEFAULT_REPEATS
    codec_backend: str | None = None     # None: $ADACC_CODEC_BACKEND, else auto
    strict: bool = False                 # an unattributed saved tensor is an error
    lossy_sources: bool = False          # auto may rebuild from compressed values
    pipeline_model_parallel_size: int = 1   # the stages the model is split over

    def __post_init__(self) -> None:
        self._check_types()
        # Messages name the flags: they are how users meet these settings.
        if not policies.is_known(self.policy):
            named = ", ".join(policies.NAMED)
            looks_like_file = (Path(self.policy).suffix in (".yaml", ".yml")
                               or os.sep in self.policy)
            raise ValueError(
                f"--adacc-policy {self.policy}: plan file not found (or give one of {named})"
                if looks_like_file else
                f"--adacc-policy {self.policy}: not one of {named} and not a plan file")
        if self.policy not in policies.NAMED:
            try:  # a plan file is read now: a bad one is refused before any model is built
                Plan.load(self.policy)
            except PlanError as exc:
                raise ValueError(f"--adacc-policy {exc}") from None
        if self.memory_budget is not None and self.policy == "none":
            raise ValueError(f"--adacc-memory-budget {self.memory_budget} has no effect with "
                             f"--adacc-policy none; drop it, or plan for it with "
                             f"--adacc-policy auto")
        if self.tracking is not None and self.tracking not in TRACKING_MODES:
            raise ValueError(f"--adacc-tracking {self.tracking}: expected one of "
                             f"{', '.join(TRACKING_MODES)}")
        if self.tracking == "backoff" and self.pipeline_model_parallel_size > 1:
            raise ValueError("--adacc-tracking backoff does not run with pipeline stages yet "
                             "(the rectifier re-plans one model, not a plan per stage); use "
                             "--adacc-tracking off with --pipeline-model-parallel-size "
                             f"{self.pipeline_model_parallel_size}")
        if self.tracks and self.policy != "auto":
            raise ValueError(f"--adacc-tracking backoff re-plans, so it needs --adacc-policy "
                             f"auto (got {self.policy})")
        if self.step_watch is not None and self.step_watch not in STEP_WATCH_MODES:
            raise ValueError(f"--adacc-step-watch {self.step_watch}: expected one of "
                             f"{', '.join(STEP_WATCH_MODES)}")
        if self.step_watch == "on" and not self.tracks:
            raise ValueError("--adacc-step-watch on swaps plans through the rectifier, so it "
                             "needs --adacc-tracking backoff (and --adacc-policy auto)")
        if self.lossy_sources and self.policy not in policies.AUTO_POLICIES:
            raise ValueError(f"--adacc-lossy-sources chooses what auto's plans rebuild from, so "
                             f"it needs --adacc-policy auto or auto-no-outlier (got "
                             f"{self.policy})")
        if self.tracking_max_interval < 1:
            raise ValueError("--adacc-tracking-max-interval must be positive")
        if self.pipeline_model_parallel_size < 1:
            raise ValueError("--pipeline-model-parallel-size must be positive")
        if not all(math.isfinite(value) and value > 0
                   for value in (self.tracking_reset_fraction, self.guard_threshold)):
            raise ValueError("--adacc-tracking-reset-fraction and --adacc-guard-threshold "
                             "must be positive and finite, got "
                             f"{self.tracking_reset_fraction} and {self.guard_threshold}")
        unknown = [site for site in self.tracking_sites or () if site not in SITE_NAMES]
        if unknown:
            raise ValueError(f"--adacc-tracking-sites: unknown {', '.join(unknown)}; valid "
                             f"sites: {', '.join(SITE_NAMES)}")
        if self.codec_backend is not None and self.codec_backend not in BACKENDS:
            raise ValueError(f"--adacc-codec-backend {self.codec_backend}: expected one of "
                             f"{', '.join(BACKENDS)}")
        budget = self.budget_bytes  # a malformed size fails here, not at setup
        if budget is not None and budget <= 0:
            raise ValueError(f"AdaccConfig.memory_budget (--adacc-memory-budget) "
                             f"{self.memory_budget}: expected a positive size, e.g. 24GiB "
                             f"(a bare number is bytes)")

    def _check_types(self) -> None:
        """TypeError naming the field and what it takes, before any value is compared.

        Keeps tracking_sites as a tuple (a list is accepted)."""
        def refuse(name: str, accepts: str) -> None:
            flag = name.replace("_", "-")
            flag = flag if name == "pipeline_model_parallel_size" else f"adacc-{flag}"
            raise TypeError(f"AdaccConfig.{name} (--{flag}) takes {accepts}, got "
                            f"{getattr(self, name)!r}")

        def whole(value) -> bool:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        def real(value) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool)

        for name in ("policy", "tracking", "codec_backend", "step_watch"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name != "policy")):
                refuse(name, "a string" if name == "policy" else "a string or None")
        if not (self.memory_budget is None or isinstance(self.memory_budget, str)
                or whole(self.memory_budget)):
            refuse("memory_budget", "a number of bytes (int), a size such as '2GiB', or None")
        sites = self.tracking_sites
        if sites is not None:
            if isinstance(sites, str) or not all(isinstance(s, str) for s in sites):
                refuse("tracking_sites", "a sequence of site names or None")
            object.__setattr__(self, "tracking_sites", tuple(sites))
        for name in ("tracking_max_interval", "pipeline_model_parallel_size"):
            if not whole(getattr(self, name)):
                refuse(name, "an integer")
        if not (self.profile_repeats is None
                or whole(self.profile_repeats) and self.profile_repeats > 0):
            refuse("profile_repeats", "a positive integer or None")
        for name in ("tracking_reset_fraction", "guard_threshold"):
            if not real(getattr(self, name)):
                refuse(name, "a number")
        if not (self.profile_db is None or isinstance(self.profile_db, (str, os.PathLike))):
            refuse("profile_db", "a path or None")
        for name in ("reprofile", "strict", "lossy_sources"):
            if not isinstance(getattr(self, name), bool):
                refuse(name, "True or False")

    @property
    def budget_bytes(self) -> int | None:
        if self.memory_budget is None or isinstance(self.memory_budget, numbers.Integral):
            return self.memory_budget
        try:
            return parse_size(self.memory_budget)
        except ValueError as exc:
            raise ValueError(f"--adacc-memory-budget: {exc}") from None

    @property
    def tracks(self) -> bool:
        """Tracking is on: asked for, or by default with auto without pipeline stages."""
        default = "backoff" if self.policy == "auto" and self.pipeline_model_parallel_size == 1 \
            else "off"
        return (self.tracking or default) == "backoff"

    @property
    def watches(self) -> bool:
        """The step watch is on: asked for, or by default while tracking."""
        return (self.step_watch or ("on" if self.tracks else "off")) == "on"

    @classmethod
    def from_args(cls, args) -> "AdaccConfig":
        """From parsed ``--adacc-*`` flags (``adacc_policy`` -> ``policy``, ...)."""
        values = {f.name: getattr(args, f"adacc_{f.name}") for f in fields(cls)
                  if hasattr(args, f"adacc_{f.name}")}
        if values.get("tracking_sites") is not None:
            values["tracking_sites"] = tuple(values["tracking_sites"])
        return cls(**values, pipeline_model_parallel_size=getattr(
            args, "pipeline_model_parallel_size", 1))


class Adacc:
    """Adacc for one model; the module docstring shows the loop it fits into."""

    def __init__(self, config: AdaccConfig | None = None, **options):
        self.config = config if config is not None else AdaccConfig(**options)
        self.model: torch.nn.Module | None = None
        self.static_bytes: int | None = None
        self.optimizer_step_bytes: int | None = None
        self.activation_bytes: int | None = None       # the ruler's last measurement
        self.activation_peak_bytes: int | None = None
        self._resolved: policies.Resolved | None = None
        self._rectifier: Rectifier | None = None
        self._batch: profiler.Batch | None = None
        self._loss_fn: LossFn | None = None
        self._micro_batches = 1
        self._watch: watching.StepWatch | None = None
        self._clock = clock.HostClock()
        # Steps measure() timed and nothing has read yet: (plan_id, start, end, ruler on).
        self._windows: list[tuple[str, object, object, bool]] = []
        self._measured_step: tuple[str, float] | None = None   # (plan_id, seconds), the last
        # (planner result, costs, {prediction: value}): its predictions, asked for every step
        self._predictions: tuple[object, ModelCosts, dict] | None = None

    # --- building the model ------------------------------------------------------------------
    def layer_spec(self, attention_backend: str = DEFAULT_SPEC_BACKEND):
        """The layer spec to build the GPTModel with.

        Policy ``none`` gets megatron-core's local spec; every other policy its Adacc
        substitution. The core attention is ``attention_backend``'s (flash, unfused or auto: see
        attention.py)."""
        if not policies.uses_runtime(self.config.policy):
            return local_layer_spec(attention_backend)
        return get_adacc_layer_spec(attention_backend)

    # --- set-up --------------------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, batch: profiler.Batch,
              loss_fn: LossFn | None = None, *, num_micro_batches: int = 1,
              verbose: bool = True, static_bytes: int | None = None,
              optimizer_step_bytes: int | None = None) -> "Adacc":
        """Resolve the policy for ``model`` and apply it; raises InfeasibleBudget when no plan fits.

        Call it before wrapping the model for data parallelism: profiling steps must not synchronise
        their throwaway gradients. Every rank plans every stage and applies its own stage's plan.

        Args:
            model: built with ``layer_spec()``; with pipeline stages, this rank's stage.
            batch: a real micro-batch of this rank (tokens, labels, loss mask), at the training
                micro-batch size.
            loss_fn: ``loss_fn(model, batch)`` gives the scalar loss. Default: the GPT
                language-model loss, a stand-in for a stage alone.
            num_micro_batches: micro-batches per step. It sets how many 1F1B keeps in flight.
            static_bytes: what this rank's parameters, gradients and optimizer hold for the whole
                run. The trainer passes ``engine_memory.engine_static_bytes``. Default:
                ``engine_memory.model_static_bytes`` (one data-parallel rank, no distributed
                optimizer), and what the device holds beside the model and the batch.
            optimizer_step_bytes: what the optimizer step adds while no activation is alive. The
                trainer passes ``engine_memory.engine_step_bytes``. Default:
                ``engine_memory.model_step_bytes``.

        Raises:
            planning.InfeasibleBudget: a ValueError naming the smallest feasible budget."""
        _check_setup_arguments(model, batch, loss_fn, num_micro_batches, static_bytes,
                               optimizer_step_bytes)
        if batch[0].device.type == "cpu":
            # glibc keeps freed memory for reuse from here on, for the whole process, so the
            # profiler's timings and training's steps see one allocator: no call pays for
            # pages faulted in afresh while another reuses them.
            allocator.recycle_freed_host_memory()
        config = self.config
        policies.require_plannable(config.policy,
                                   getattr(getattr(model, "config", None),
                                           "recompute_granularity", None))
        stages = policies.pipeline_stage()[1]
        if stages != config.pipeline_model_parallel_size:
            raise InputError(f"the model is split over {stages} pipeline stages, but Adacc "
                             f"was configured for {config.pipeline_model_parallel_size}")
        self.model, self._batch = model, batch
        self._loss_fn = loss_fn
        self._micro_batches = num_micro_batches
        self._clock = clock.for_device(batch[0].device)
        if static_bytes is None:
            device = next(model.parameters()).device
            static_bytes = engine_memory.model_static_bytes(model) + engine_memory.held_beside(
                device, engine_memory.model_held_bytes(model, device), batch)
        self.static_bytes = static_bytes
        self.optimizer_step_bytes = (optimizer_step_bytes if optimizer_step_bytes is not None
                                     else engine_memory.model_step_bytes(model))
        self._resolved = policies.resolve(
            config.policy, self._budget(), model, batch, db=ProfileDB(config.profile_db),
            reprofile=config.reprofile, repeats=config.profile_repeats, strict=config.strict,
            loss_fn=loss_fn,
            num_micro_batches=num_micro_batches, static_bytes=self.static_bytes,
            optimizer_step_bytes=self.optimizer_step_bytes, lossy_sources=config.lossy_sources)
        if self._resolved.plan is not None:
            self._apply(self._resolved.plan)
        if config.tracks and self._resolved.result is not None:
            self._rectifier = Rectifier(
                self._resolved.costs, self._resolved.result,
                self._resolved.budget_bytes, policy=config.policy, sites=config.tracking_sites,
                guard_threshold=config.guard_threshold,
                reset_fraction=config.tracking_reset_fraction,
                max_interval=config.tracking_max_interval,
                allow_lossy_sources=config.lossy_sources, strict=config.strict)
            if config.watches:
                self._watch = watching.StepWatch()
                self._watch.begin(self._rectifier.result)
        if verbose and policies.is_rank0() and self._resolved.plan is not None:
            print(policies.describe(self._resolved), flush=True)
        if self._resolved.result is not None:
            self._warn_last_resort(self._resolved.result)
        return self

    def _require_setup(self, call: str) -> None:
        if self._resolved is None:
            raise RuntimeError(f"Adacc.{call}(): call setup() first")

    def _warn_last_resort(self, result) -> None:
        warning = policies.last_resort_warning(self.config.policy, result)
        if warning is not None and policies.is_rank0():
            print(warning, flush=True)

    def _budget(self) -> int | None:
        budget = self.config.budget_bytes
        return budget if budget is not None else policies.default_budget()

    def _apply(self, plan: Plan) -> None:
        apply_plan(self.model, plan, strict=self.config.strict,
                   codec_backend=self.config.codec_backend)

    # --- every step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def measure(self, enabled: bool = True) -> Iterator[ActivationRuler | None]:
        """Context manager around every training step: all micro-batches' forward and backward.

        Each step is timed (``measured_step_time_s``), and the step watch compares those times with
        the plan's prediction. On a GPU, CUDA events time the step and are read after a later step,
        so the host never waits. There the allocator's peak statistics are also reset as the step
        begins, and its peak is the plan's measured peak (``torch.cuda.max_memory_allocated``
        then holds this step's, not the run's).

        With ``enabled``, the byte ruler also measures two values. Its hooks cost time, so measure
        the first step and then now and then; the step watch leaves those steps out.

        - ``activation_bytes``: the most kept for backward when a forward ends, all in-flight
          micro-batches together.
        - ``activation_peak_bytes``: the step's peak, with backward's decoded and rebuilt values."""
        self._require_setup("measure")
        device = self._batch[0].device
        allocator.reset_peak(device)
        plan_id, start = self.plan_id, self._clock.mark()
        if not enabled:
            yield None
            self._windows.append((plan_id, start, self._clock.mark(), False))
        else:
            with ActivationRuler(self.model, strict=self.config.strict) as ruler:
                yield ruler
            self._windows.append((plan_id, start, self._clock.mark(), True))
            report = ruler.report()
            self.activation_bytes = report.after_forward_bytes
            self.activation_peak_bytes = report.peak_bytes
        peak = allocator.peak(device)
        if peak is not None and self._watch is not None:
            self._watch.record_peak(plan_id, peak)
        self._read_windows()

    def _read_windows(self) -> None:
        """Read the timed steps: all of them on a CPU, all but the newest on a GPU.

        The newest step's events may still be ahead of the host; the next read takes it. Every
        rank reads at the same steps, and the host runs at most one step ahead of the one it
        reads."""
        ready = self._windows[:-1] if self._clock.deferred else self._windows
        for plan_id, start, end, ruled in ready:
            seconds = self._clock.seconds(start, end)
            self._measured_step = (plan_id, seconds)
            if self._watch is not None and not ruled:
                self._watch.record(plan_id, seconds)
        del self._windows[:len(ready)]

    def after_step(self, iteration: int,
                   batch: profiler.Batch | Callable[[], profiler.Batch] | None = None) -> dict:
        """Run after optimizer step ``iteration`` (1-based); returns the tracking record or {}.

        - On tracking iterations the rectifier samples ``batch`` (default: the set-up batch). A
          better plan, if it finds one, is applied before the next forward.
        - Every few steps the step watch decides (step_watch.py). When the plan ran slower than
          predicted, it re-times the plan's actions on ``batch`` and swaps plans the same way. Its
          record is under ``step_watch``.

        Otherwise it does nothing and returns {} (or only the tracking time so far). ``batch``
        may be a function that returns it: it is then called only on the steps that read it,
        so the others copy nothing to the device."""
        self._require_setup("after_step")
        rect = self._rectifier
        if rect is None:
            return {}
        self._read_windows()
        @functools.cache
        def step_batch() -> profiler.Batch:
            return (batch() if callable(batch) else batch) or self._batch

        record = {}
        if rect.schedule.is_tracking(iteration):
            outcome = rect.observe(iteration, self.model, step_batch(), loss_fn=self._loss_fn)
            if outcome.infeasible and policies.is_rank0():
                print(f"adacc: iteration {iteration}: warning: {outcome.infeasible}; "
                      "running the plan that overruns it least", flush=True)
            if outcome.swap is not None:
                self._take(iteration, outcome.swap)
            record = outcome.to_record()
        if self._watch is not None:
            record.update(self._watch_step(iteration, step_batch, "plan_swap" in record))
        record["tracking_time_s_total"] = rect.tracking_time_s
        return record

    def state_dict(self) -> dict | None:
        """Tracking's state, for a checkpoint: plain data; None when the run does not track.

        A run resumed with ``load_state_dict`` runs the plan in force and decides as this run
        would have. The step watch starts afresh: its decisions rest on step times."""
        self._require_setup("state_dict")
        return self._rectifier.state_dict() if self._rectifier is not None else None

    def load_state_dict(self, state: dict) -> None:
        """Continue tracking from ``state_dict()`` of a run of this model, and apply its plan.

        Raises:
            ValueError: the state is another model's."""
        self._require_setup("load_state_dict")
        if self._rectifier is None:
            return
        self._rectifier.load_state_dict(state)
        self._apply(self._rectifier.result.plan)
        if self._watch is not None:
            self._watch.begin(self._rectifier.result)

    def _take(self, iteration: int, swap) -> None:
        """Apply the rectifier's ``swap`` (its own or the step watch's) and say so."""
        watch, measured = self._watch, None
        if watch is not None:   # both plans ran: their medians say more than the prediction
            old_s, new_s = watch.median(swap.old.plan.plan_id), watch.median(swap.new.plan.plan_id)
            measured = old_s - new_s if old_s is not None and new_s is not None else None
        self._apply(swap.new.plan)
        self._warn_last_resort(swap.new)
        if watch is not None:
            watch.begin(swap.new)
        if policies.is_rank0():
            print(swap.describe(iteration, self._micro_batches, measured), flush=True)

    def _watch_step(self, iteration: int, batch: Callable[[], profiler.Batch],
                    tracking_swapped: bool) -> dict:
        """The step watch after a step, or its decision at a decision point.

        When tracking has just swapped to a plan measured slower, it goes back to the fastest
        one."""
        watch, rect = self._watch, self._rectifier

        def fit(result) -> bool:
            return watching.fits(rect.costs, result, rect.budget_bytes)

        def predicted(result) -> float | None:
            return watching.predicted_step_s(rect.costs, result, self._micro_batches)

        def retime() -> watching.Candidates:
            options = {"allow_lossy_sources": rect.allow_lossy_sources}

            def refresh(costs, decisions, step):
                costs = profiler.refresh_action_costs(
                    costs, self.model, batch(), decisions, repeats=watching.RETIME_REPEATS,
                    strict=self.config.strict, loss_fn=self._loss_fn, step=step)
                return ModelCosts.from_json(policies.from_rank0(costs.to_json()))

            def replan(costs):
                try:
                    return self._plan_for(costs)
                except planning.InfeasibleBudget:
                    return None

            rect.costs, new = watching.retime(rect.costs, rect.result.layer_decisions,
                                              refresh, replan)
            bare = watching.recompute_only(rect.policy, rect.costs, rect.budget_bytes,
                                           **options)
            return watching.Candidates([new] if new is not None else [],
                                       [bare] if bare is not None else [])

        if tracking_swapped:        # to a plan measured slower than another that fits?
            watch.times = policies.from_rank0(watch.times)
            faster = watch.faster_than(self.plan_id, fit)
            if faster is not None:
                self._take(iteration, rect.take(faster, watching.MEASURED_SLOWER))
                return {"step_watch": {"plan_id": faster.plan.plan_id,
                                       "reason": watching.MEASURED_SLOWER}}
        if not watch.due:
            return {}
        # rank 0's times and peaks decide
        watch.times, watch.peaks = policies.from_rank0((watch.times, watch.peaks))
        started = time.perf_counter()
        corrected = self._correct_memory(iteration)
        if corrected is not None:
            watch.fresh = 0
            return {"step_watch": {**corrected, "time_s": time.perf_counter() - started}}
        decision = watch.decide(rect.result, predicted, fit, retime)
        if decision.retimed and policies.is_rank0():
            print(f"adacc: iteration {iteration}: plan {decision.plan_id} ran "
                  f"{decision.median_s * 1e3:.1f} ms a step, predicted "
                  f"{decision.predicted_s * 1e3:.1f} ms: its actions re-timed", flush=True)
        record = {**decision.to_record(), "time_s": time.perf_counter() - started}
        if decision.swap_to is not None:
            swap = rect.take(decision.swap_to, decision.reason)
            self._take(iteration, swap)
            record["changed"] = swap.changed
        return {"step_watch": record}

    def _plan_for(self, costs: ModelCosts) -> planning.PlanResult:
        """The tracked policy's plan for the budget under ``costs`` (raises InfeasibleBudget)."""
        rect = self._rectifier
        return policies.plan(rect.policy, costs, rect.budget_bytes,
                             allow_lossy_sources=rect.allow_lossy_sources)

    def _correct_memory(self, iteration: int) -> dict | None:
        """Re-plan when the current plan's measured peak overran its prediction; else None.

        The excess is memory the model misses (on the H200, about 200 MB in GPT-345M's plans),
        so it counts in every plan's peak from here on. Not with pipeline stages, whose ranks
        hold different plans."""
        rect, plan_id = self._rectifier, self.plan_id
        measured, predicted = self._watch.peaks.get(plan_id), self.predicted_peak_bytes
        excess = watching.peak_excess(measured, predicted)
        if not excess or policies.pipeline_stage()[1] > 1:
            return None
        rect.costs = replace(rect.costs, allocator_overhead_bytes=(
            rect.costs.allocator_overhead_bytes + excess))
        self._watch.peaks.clear()       # measured under the old model's plans
        record = {"plan_id": plan_id, "measured_peak_bytes": measured,
                  "predicted_peak_bytes": predicted, "allocator_overhead_bytes":
                  rect.costs.allocator_overhead_bytes}
        if policies.is_rank0():
            mib = 1 << 20
            print(f"adacc: iteration {iteration}: plan {plan_id} peaked {measured / mib:,.1f} "
                  f"MiB, predicted {predicted / mib:,.1f} MiB: {excess / mib:,.1f} MiB more "
                  "in every plan's peak from here on", flush=True)
        try:
            new = self._plan_for(rect.costs)
        except planning.InfeasibleBudget as exc:
            if policies.is_rank0():
                print(f"adacc: iteration {iteration}: warning: {exc}; keeping plan {plan_id}",
                      flush=True)
            return {**record, "infeasible": str(exc)}
        if new.plan.plan_id != plan_id:
            swap = rect.take(new, watching.OVER_BUDGET)
            self._take(iteration, swap)
            record.update(to=new.plan.plan_id, reason=watching.OVER_BUDGET, changed=swap.changed)
        return record

    # --- readings ------------------------------------------------------------------------------
    @property
    def rectifier(self) -> Rectifier | None:
        """The rectifier while tracking is on."""
        return self._rectifier

    @property
    def result(self):
        """The current planner result (auto policies), None for fixed plans."""
        if self._rectifier is not None:
            return self._rectifier.result
        return self._resolved.result if self._resolved is not None else None

    @property
    def plan(self) -> Plan | None:
        """The plan the layers run now (None: megatron's stock layer).

        With pipeline stages, it is this rank's stage's plan, its layers numbered as in the
        model."""
        if self._rectifier is not None:
            return self._rectifier.result.plan
        return self._resolved.plan if self._resolved is not None else None

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id if self.plan is not None else "none"

    @property
    def costs(self) -> ModelCosts | None:
        """The costs the current plan was planned with (refreshed by tracking)."""
        if self._rectifier is not None:
            return self._rectifier.costs
        return self._resolved.costs if self._resolved is not None else None

    @property
    def budget_bytes(self) -> int | None:
        return self._resolved.budget_bytes if self._resolved is not None else None

    @property
    def stage_plans(self):
        """Every pipeline stage's plan, as every rank planned them (auto policies only).

        Each is a planning.StagePlan; there is one without pipelining. None for fixed plans."""
        return self._resolved.stages if self._resolved is not None else None

    @property
    def step_watch(self) -> watching.StepWatch | None:
        """The step watch while it is on (step_watch.py)."""
        return self._watch

    def _predicted(self, name: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, evaluated once per plan and costs: every step's record asks for it."""
        cached = self._predictions
        if cached is None or cached[0] is not self.result or cached[1] is not self.costs:
            self._predictions = cached = (self.result, self.costs, {})
        if name not in cached[2]:
            cached[2][name] = compute()
        return cached[2][name]

    @property
    def predicted_step_time_s(self) -> float | None:
        """The predicted forward and backward time of a step under the current plan.

        It adds the overhead the step watch measured. Only for auto policies without pipeline
        stages; None otherwise."""
        if self.result is None or policies.pipeline_stage()[1] > 1:
            return None
        predicted = self._predicted("step_s", lambda: watching.predicted_step_s(
            self.costs, self.result, self._micro_batches))
        if predicted is not None and self._watch is not None:
            # what the step watch measures a step spends outside the modelled work
            predicted += self._watch.overhead_s
        return predicted

    @property
    def predicted_activation_bytes(self) -> int | None:
        """What the planner predicts ``activation_bytes`` will measure (auto policies)."""
        if self.result is None:
            return None
        return self._predicted("activation_bytes", lambda: policies.predicted_activation_bytes(
            self.costs, self.result))

    @property
    def predicted_activation_peak_bytes(self) -> int | None:
        """The ``activation_peak_bytes`` the planner predicts, an upper bound (auto policies)."""
        if self.result is None:
            return None
        return self._predicted("activation_peak_bytes",
                               lambda: policies.predicted_activation_peak_bytes(self.costs,
                                                                                self.result))

    @property
    def predicted_peak_bytes(self) -> int | None:
        """The peak memory the planner predicts for the current plan, static included."""
        if self.result is None:
            return None
        return self._predicted("peak_bytes",
                               lambda: policies.predicted_peak_bytes(self.costs, self.result))

    def metrics(self) -> dict:
        """The numbers a metrics record carries about Adacc on this rank.

        With pipeline stages they are its stage's plan, activations and predictions."""
        self._require_setup("metrics")
        record = {"static_bytes": self.static_bytes, "budget_bytes": self.budget_bytes,
                  "plan_id": self.plan_id}
        stage, stages = policies.pipeline_stage()
        if stages > 1:
            record["pipeline_stage"] = stage
        if self.activation_bytes is not None:
            record["activation_bytes"] = self.activation_bytes
            record["activation_peak_bytes"] = self.activation_peak_bytes
        self._read_windows()
        if self._measured_step is not None:
            record["measured_plan_id"], record["measured_step_time_s"] = self._measured_step
        if self.predicted_step_time_s is not None:
            record["predicted_step_time_s"] = self.predicted_step_time_s
        if self.result is not None:
            record["predicted_activation_bytes"] = self.predicted_activation_bytes
            record["predicted_activation_peak_bytes"] = self.predicted_activation_peak_bytes
            record["predicted_peak_bytes"] = self.predicted_peak_bytes
        if stages > 1:
            # Rank 0 writes the records: it gets every stage's readings.
            record["stages"] = policies.from_every_stage(
                {key: record.get(key) for key in _STAGE_METRICS})
        return record

    def describe(self) -> str:
        """Where the costs came from and the plan table (what ``setup`` prints)."""
        return policies.describe(self._resolved)


def _check_setup_arguments(model, batch, loss_fn, num_micro_batches: int,
                           static_bytes: int | None, optimizer_step_bytes: int | None) -> None:
    """TypeError/ValueError naming the argument of ``setup`` that has the wrong shape."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Adacc.setup: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if (not isinstance(batch, (tuple, list)) or len(batch) != 3
            or not all(isinstance(t, torch.Tensor) for t in batch)):
        got = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list))
               else f"a {type(batch).__name__}")
        raise TypeError(f"Adacc.setup: batch must be (tokens, labels, loss_mask), three "
                        f"tensors, got {got}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"Adacc.setup: loss_fn must be callable(model, batch) or None, got "
                        f"{type(loss_fn).__name__}")
    if (isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, numbers.Integral)
            or num_micro_batches < 1):
        raise ValueError(f"Adacc.setup: num_micro_batches must be a positive integer, got "
                         f"{num_micro_batches!r}")
    for name, value in (("static_bytes", static_bytes),
                        ("optimizer_step_bytes", optimizer_step_bytes)):
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, numbers.Integral) or value < 0):
            raise ValueError(f"Adacc.setup: {name} must be a non-negative integer or None, "
                             f"got {value!r}")


_STAGE_METRICS = ("pipeline_stage", "plan_id", "static_bytes", "activation_bytes",
                  "activation_peak_bytes", "predicted_activation_bytes",
                  "predicted_activation_peak_bytes", "predicted_peak_bytes")

