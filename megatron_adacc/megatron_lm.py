"""Adacc inside Megatron-LM's own training loop (``megatron.training.pretrain``).

A Megatron-LM ``pretrain_gpt.py`` adds two calls (docs/megatron-lm.md):

    args = parse_and_validate_args(extra_args_provider=megatron_lm.add_arguments, ...)
    model_cfg = gpt_config_from_args(args)
    megatron_lm.install(model_cfg, args)

``install`` puts Adacc's layer spec and a pre-wrap hook on the model config. It also wraps three
functions of ``megatron.training.training`` that ``train()`` calls by name:

- ``train_step``: the first one profiles and plans (``Adacc.setup``) on the real first micro-batch,
  with megatron's DDP and optimizer built. In every one the forward and backward run under
  ``Adacc.measure``, and the step's first micro-batch is kept.
- ``training_log``: Adacc's readings join the loss dict, so they appear in Megatron-LM's log line
  and TensorBoard.
- ``post_training_step_callbacks``: ``Adacc.after_step``, then one JSON line per iteration in
  ``--metrics-file``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_adacc.common.errors import InputError

# Core attention under --transformer-impl local, by --attention-backend. Megatron-LM's local
# spec runs megatron-core's DotProductAttention whatever the backend; "flash" runs PyTorch's
# scaled_dot_product_attention instead (its flash kernel on a GPU), "auto" picks it where
# that kernel runs the attention dropout.
LOCAL_IMPL_ATTENTION = {"local": "unfused", "unfused": "unfused", "fused": "unfused",
                        "flash": "flash", "auto": "auto"}


# Tracking's state (Adacc.state_dict) in a checkpoint's iter_* directory: what a resumed run
# needs to run the plan in force and decide as the saving run would have.
ADACC_STATE_FILE = "adacc_tracking.json"


class ConfigError(InputError):
    """A bad flag or config key: one line that says what to change."""


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the ``--adacc-*`` flags and the metrics file."""
    from megatron_adacc.profiling.profiler import DEFAULT_REPEATS

    adacc = parser.add_argument_group("adacc")
    adacc.add_argument("--adacc-policy", default="none",
                       help="none (Megatron-LM's layer), auto (profile and plan for "
                            "--adacc-memory-budget), auto-no-outlier, full-recompute, quantize, "
                            "or a plan YAML file")
    adacc.add_argument("--adacc-memory-budget", default=None,
                       help="memory for parameters, optimizer and activations, e.g. 12GiB; "
                            "default on a GPU: its free memory once the model is built, less "
                            "1 GiB; required with auto on a CPU")
    adacc.add_argument("--adacc-reprofile", action="store_true",
                       help="measure the model again instead of reusing the ProfileDB")
    adacc.add_argument("--adacc-profile-repeats", type=_positive_int, default=None,
                       help=f"timed steps per measurement in auto's profile (default "
                            f"{DEFAULT_REPEATS}): fewer profile sooner, and noisier")
    adacc.add_argument("--adacc-profile-db", default=None,
                       help="ProfileDB file (default: $ADACC_DATA_DIR/profiles.sqlite)")
    adacc.add_argument("--adacc-codec-backend", default=None,
                       choices=("auto", "torch", "native", "triton"),
                       help="codec kernels (default: $ADACC_CODEC_BACKEND, else auto)")
    adacc.add_argument("--adacc-lossy-sources", action="store_true",
                       help="auto: let a recomputed value be rebuilt from a compressed one "
                            "(smaller plans; the rebuilt values carry the codec's error)")
    adacc.add_argument("--adacc-strict", action="store_true",
                       help="fail on a saved tensor that no site accounts for")
    adacc.add_argument("--adacc-tracking", choices=["backoff", "off"], default=None,
                       help="auto only: re-measure the tracked sites at iterations 1, 2, 4, ... "
                            "and swap to a better plan (default: backoff with auto)")
    adacc.add_argument("--adacc-step-watch", choices=["on", "off"], default=None,
                       help="time every step and re-plan when the plan runs 10%% over its "
                            "prediction (default: on while tracking)")
    adacc.add_argument("--adacc-tracking-max-interval", type=_positive_int, default=256,
                       help="the backoff stops doubling at this many iterations")
    adacc.add_argument("--adacc-tracking-sites", nargs="*", default=None,
                       help="sites to re-measure (default: the outlier-separated ones)")
    adacc.add_argument("--adacc-tracking-reset-fraction", type=_positive_float, default=0.25,
                       help="a compression rate moving by more than this resets the backoff")
    adacc.add_argument("--adacc-guard-threshold", type=_positive_float, default=0.2,
                       help="a site whose relative error exceeds this is never compressed")
    adacc.add_argument("--activation-measure-interval", type=_positive_int, default=50,
                       help="measure activation bytes on the first step and every N steps")
    adacc.add_argument("--metrics-file", default=None,
                       help="JSON lines, one per iteration (rank 0)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse what Adacc cannot run, in one line, before anything is built."""
    from megatron_adacc import policies
    from megatron_adacc.adacc import AdaccConfig
    from megatron_adacc.models import family

    try:
        config = AdaccConfig.from_args(args)
        if not torch.cuda.is_available():  # a GPU's default is read once the model is built
            policies.require_budget(config.policy, config.budget_bytes)
        policies.require_plannable(config.policy, args.recompute_granularity)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    heads, groups = args.num_attention_heads, args.num_query_groups
    if args.group_query_attention and groups and heads % groups:
        # Megatron-LM accepts it and fails in the first forward with a reshape error.
        raise ConfigError(f"--num-query-groups {groups} does not divide "
                          f"--num-attention-heads {heads}")
    if args.mtp_num_layers:
        raise ConfigError("--mtp-num-layers: multi-token prediction is not supported yet "
                          "(pretrain_gpt.py's forward step does not feed it)")
    if args.fp8 and args.transformer_impl == "local":
        # megatron-core's local spec has no fp8 layers: the run would train without it.
        raise ConfigError(f"--fp8-format {args.fp8} runs in Transformer Engine's layers on a "
                          f"GPU; --transformer-impl local has no fp8")
    if args.context_parallel_size > 1 and args.transformer_impl == "local":
        # megatron-core asserts it while building the first attention layer.
        raise ConfigError(f"--context-parallel-size {args.context_parallel_size} runs only in "
                          f"Transformer Engine's attention, and --transformer-impl local has "
                          f"none")
    if config.policy != "none" and args.transformer_impl != "local":
        raise ConfigError(f"--adacc-policy {config.policy} runs Adacc's layer, which builds on "
                          f"megatron-core's local spec; add --transformer-impl local "
                          f"(Transformer Engine's spec is not supported yet)")
    fsdp = ("--use-megatron-fsdp" if args.use_megatron_fsdp
            else "--use-torch-fsdp2" if args.use_torch_fsdp2 else None)
    if fsdp and policies.uses_runtime(config.policy):
        # engine_memory reads DistributedDataParallel's buffers for the budget's static bytes
        raise ConfigError(f"--adacc-policy {config.policy} budgets DistributedDataParallel's "
                          f"buffers, and {fsdp} shards them its own way, which Adacc does not "
                          f"count yet; drop one of them")
    if policies.uses_runtime(config.policy):
        try:
            family.require_modelled_layer(args)
        except ValueError as exc:
            raise ConfigError(f"--adacc-policy {config.policy}: {exc}; without a policy "
                              f"(--adacc-policy none) Megatron-LM trains it as it is") from None
        _check_codec_backend(config.codec_backend)
    if (args.recompute_granularity == "selective" and "mlp" in (args.recompute_modules or [])
            and args.add_bias_linear):
        # megatron-core 0.19.2: the checkpointed MLP returns the fc2 bias parameter, and its
        # backward recurses forever.
        raise ConfigError("--recompute-modules mlp with biased linear layers hangs in "
                          "megatron-core 0.19.2; add --disable-bias-linear or drop mlp")
    if args.multi_latent_attention and args.transformer_impl == "local":
        # megatron-core 0.19.2's MLA hands the local DotProductAttention a k_channels argument
        # it does not take: the model build fails with a TypeError.
        raise ConfigError("--multi-latent-attention builds only on Transformer Engine's spec in "
                          "megatron-core 0.19.2 (its local core attention takes no k_channels); "
                          "drop --transformer-impl local")
    if args.num_experts and args.add_bias_linear and args.transformer_impl == "local":
        # megatron-core 0.19.2's local experts add their bias in place to a view autograd
        # forbids modifying: the first forward fails.
        raise ConfigError(f"--num-experts {args.num_experts} with biased linear layers fails in "
                          f"megatron-core 0.19.2's local experts; add --disable-bias-linear")
    if args.num_experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        # megatron-core 0.19.2's MoE layer raises a ValueError in the first training forward.
        raise ConfigError(f"--num-experts with --tensor-model-parallel-size "
                          f"{args.tensor_model_parallel_size} trains only under "
                          f"--sequence-parallel in megatron-core 0.19.2; add it")
    args.adacc_tracking = "backoff" if config.tracks else "off"
    args.adacc_memory_budget = config.budget_bytes


def _check_codec_backend(flag: str | None) -> None:
    """Refuse codec kernels that cannot run on this machine, before anything is built."""
    from megatron_adacc.codecs import backend

    given = (f"--adacc-codec-backend {flag}" if flag is not None
             else f"${backend.BACKEND_ENV_VAR}")
    try:
        name = backend.resolve_backend(flag)
    except ValueError as exc:
        raise ConfigError(f"{given}: {exc}") from None
    reason = backend.unusable(name, "cuda" if torch.cuda.is_available() else "cpu")
    if reason is not None:
        raise ConfigError(f"{given}: {reason}; auto picks kernels that run here")


def local_attention(args: argparse.Namespace) -> str:
    """The core attention (attention.py's backend name) of ``--attention-backend``, local spec."""
    name = getattr(args.attention_backend, "name", str(args.attention_backend))
    if name not in LOCAL_IMPL_ATTENTION:
        raise ConfigError(f"--attention-backend {name} is Transformer Engine's; under "
                          f"--transformer-impl local use one of "
                          f"{', '.join(LOCAL_IMPL_ATTENTION)}")
    return LOCAL_IMPL_ATTENTION[name]


def layer_spec(args: argparse.Namespace, adacc, backend: str, model_cfg, vp_stage=None):
    """The layers of ``--transformer-impl local``: Megatron-LM's, or Adacc's under a policy.

    Without a policy it is Megatron-LM's own spec for every flag (experts, query-key norms, ...);
    a policy's is Adacc's dense layer, which check_args held the flags to. Either computes
    attention with ``backend``'s core attention."""
    from megatron.training.models.gpt import default_layer_spec

    from megatron_adacc import policies
    from megatron_adacc.models import attention, build

    if policies.uses_runtime(adacc.config.policy):
        spec = adacc.layer_spec(backend)
    else:
        spec = default_layer_spec(model_cfg, vp_stage)
        if backend != attention.DEFAULT_SPEC_BACKEND:  # the local spec's own
            spec = attention.with_attention_backend(spec, backend)
    if args.sequence_parallel or args.layernorm_zero_centered_gamma:
        # Without Apex, megatron's local spec norms with WrappedTorchNorm, which asserts under
        # sequence parallelism and zero-centred gamma: the block's norms become TorchNorms.
        spec = build.torch_norm_block(model_cfg.transformer, spec, vp_stage)
    return spec


# Records a session keeps for readers in its process (benches, tests): about 1.5 KB each, so a
# run of 500,000 iterations that kept them all would hold some 750 MB on every rank.
RECORDS_KEPT = 10_000


class Session:
    """Adacc's state over one ``pretrain`` call: the Adacc, its model and the metrics file."""

    def __init__(self, args: argparse.Namespace):
        from megatron_adacc.adacc import Adacc, AdaccConfig

        self.args = args
        self.adacc = Adacc(AdaccConfig.from_args(args))
        self.model: torch.nn.Module | None = None   # the unwrapped GPTModel of this rank
        self.ready = False
        self.step_batch = None
        self.step_started = 0.0
        self.record: dict = {}
        self.val_loss: float | None = None
        self.records: list[dict] = []   # the newest RECORDS_KEPT at least; --metrics-file: all
        self._held: dict | None = None  # the last record, until its loss is on the host
        # Megatron-LM's engine of this run, as the last step left it (tests read them).
        self.ddp_models: list | None = None
        self.rank_static_bytes: int | None = None
        self.optimizer = None
        self.scheduler = None
        self.device = torch.device("cpu")  # where the allocator is read: the model's
        self.forward_backward_peak: int | None = None
        self.ruled_plan_id: str | None = None   # the plan of the last step the ruler measured
        self._metrics = None

    # --- model build -------------------------------------------------------------------------
    def remember_model(self, model_chunks: list) -> list:
        """Pre-wrap hook: keep this rank's GPTModel, before DDP and Float16Module wrap it."""
        if len(model_chunks) == 1:
            self.model = model_chunks[0]
        elif self.adacc.config.policy != "none":
            raise ConfigError(f"--adacc-policy {self.adacc.config.policy} plans one model "
                              f"chunk per rank; drop --num-layers-per-virtual-pipeline-stage")
        # Else Megatron-LM's virtual pipeline runs as it is, without Adacc's ruler: the
        # records keep the loop's own readings.
        return model_chunks

    # --- the step ----------------------------------------------------------------------------
    def train_step(self, original, forward_step_func, data_iterator, model, optimizer,
                   opt_param_scheduler, config, forward_backward_func, *args, **kwargs):
        if self.model is None:  # virtual pipeline chunks under policy none
            self.step_started = time.perf_counter()
            result = original(forward_step_func, data_iterator, model, optimizer,
                              opt_param_scheduler, config, forward_backward_func,
                              *args, **kwargs)
            self.record = {"step_time_s": time.perf_counter() - self.step_started}
            return result
        iteration = self.args.curr_iteration if hasattr(self.args, "curr_iteration") else 0
        data_iterator = self._keep_first(data_iterator)
        if not self.ready:
            self._setup(model, optimizer, forward_step_func)
        # Adacc times the micro-batches' forward and backward, as the profile timed the step it
        # predicts from: the optimizer step is no plan's, and left in it would read as the plan
        # running over its prediction.
        # Also the first step of a plan tracking swapped in: the log line shows the bytes measured
        # beside the plan's prediction, and an older plan's would read as a misprediction.
        ruled = (self.adacc.activation_bytes is None
                 or iteration % self.args.activation_measure_interval == 0
                 or self.adacc.plan_id != self.ruled_plan_id)
        self.ruled_plan_id = self.adacc.plan_id if ruled else self.ruled_plan_id
        forward_backward_func = functools.partial(self._measured, forward_backward_func, ruled)
        from megatron_adacc.profiling import allocator

        # The host's time, not waited for: over a run the host keeps pace with the device
        # (Megatron-LM reads the gradient norm on the host every step), so the median is its step.
        self.step_started, self.forward_backward_peak = time.perf_counter(), None
        with allocator.watch(self.device) as peaks:
            result = original(forward_step_func, data_iterator, model, optimizer,
                              opt_param_scheduler, config, forward_backward_func,
                              *args, **kwargs)
        self.record = {"step_time_s": time.perf_counter() - self.step_started,
                       "activation_measured": ruled}
        if self.device.type == "cuda":  # the caching allocator's peaks over the step
            self.record.update(memory_allocated_before=peaks.allocated_before,
                               max_memory_allocated=peaks.max_allocated,
                               max_memory_reserved=peaks.max_reserved,
                               max_memory_allocated_forward_backward=self.forward_backward_peak)
        return result

    def _measured(self, forward_backward_func, ruled: bool, *args, **kwargs):
        from megatron_adacc.profiling import allocator

        with self.adacc.measure(ruled):
            result = forward_backward_func(*args, **kwargs)
        # The step's peak up to the optimizer step (None on a CPU), so a record says which part
        # peaked.
        self.forward_backward_peak = allocator.peak(self.device)
        return result

    def _keep_first(self, data_iterator):
        """The step's iterator, whose first micro-batch is kept for setup and after_step."""
        if data_iterator is None or isinstance(data_iterator, list):
            return data_iterator
        # Megatron-LM wraps the loader in a RerunDataIterator, which must stay the iterator
        # train_step gets: the peeked micro-batch goes back in front of what it wraps.
        # One _PutBack for the run: a new one each step around the last would nest a level a
        # step, and a thousand steps in, next() exceeded Python's recursion limit.
        inner = getattr(data_iterator, "iterable", data_iterator)
        try:
            head = next(inner)
        except StopIteration:
            return data_iterator
        self.step_batch = head
        if inner is data_iterator:
            return _PutBack(inner, head)
        if type(inner) is not _PutBack:
            inner = data_iterator.iterable = _PutBack(inner)
        inner.kept.append(head)
        return data_iterator

    def _setup(self, ddp_models: list, optimizer, forward_step_func=None) -> None:
        from megatron_adacc.profiling import engine_memory

        self.ready = True
        self.ddp_models, self.optimizer = ddp_models, optimizer
        self.device = next(self.model.parameters()).device
        self.step_batch = self._shared_batch()
        held, to_come = engine_memory.engine_bytes(ddp_models, optimizer)
        static = held + to_come + engine_memory.held_beside(self.device, held,
                                                           self.step_batch.values())
        step = engine_memory.engine_step_bytes(optimizer)
        self.rank_static_bytes = static  # this rank's; Adacc plans every rank with the most
        from megatron_adacc.models import build

        static, step = build.max_over([static, step])  # one budget, so every rank plans alike
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        loss_fn = (functools.partial(self.loss, forward_step_func)
                   if forward_step_func is not None else None)
        from megatron_adacc.planning import InfeasibleBudget

        try:
            with _throwaway_passes(ddp_models):
                self.adacc.setup(self.model, batch_tuple(self.step_batch, self.model),
                                 loss_fn, num_micro_batches=get_num_microbatches(),
                                 static_bytes=static, optimizer_step_bytes=step)
        except InfeasibleBudget as exc:  # the flag's budget: one line, exit status 2
            raise ConfigError(str(exc)) from None
        self._resume_tracking()

    def loss(self, forward_step_func, model: torch.nn.Module, batch) -> torch.Tensor:
        """The loss a training step backpropagates for ``batch`` (tokens, labels, loss mask).

        It is ``forward_step_func`` under Megatron-LM's schedule, scaled as its backward scales it.
        It saves for backward what a step of the loop saves, so the profile predicts the loop's
        bytes:

        - the loader's position ids and attention mask;
        - the loss function's tensors, the token count and the loss scale.

        A pipeline stage is profiled alone, as profiler.gpt_loss profiles it. It gets stand-in
        hidden states without the embedding and backpropagates its output's sum without the
        output layer."""
        from megatron.core import mpu
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.pipeline_parallel import schedules

        from megatron_adacc.profiling import profiler

        config, last = model.config, mpu.is_pipeline_last_stage()
        inputs = None if model.pre_process else profiler.stand_in_input(model, batch[0])
        # Untimed: a profiling step is none of the loop's, and the profiler may end one midway
        # (past the layer it measures), which would leave Megatron-LM's forward timer running.
        timers, config.timers = config.timers, None
        try:
            output, _ = schedules.forward_step(
                forward_step_func, iter([self.loader_batch(batch)]), model,
                get_num_microbatches(), inputs, [], config,
                mpu.get_context_parallel_world_size(), is_last_stage=last)
        finally:
            config.timers = timers
        if not last:
            return output.float().sum()
        return config.grad_scale_func(output) if config.grad_scale_func is not None else output

    def loader_batch(self, batch) -> dict:
        """The data loader's micro-batch for ``batch`` (tokens, labels, loss mask).

        It adds the other fields of this step's micro-batch (position ids, attention mask). They
        are cut to the batch's shape when the profiler times a shorter one."""
        tokens, labels, loss_mask = batch
        size, length = tokens.shape
        loader = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        for key, value in self.step_batch.items():
            if key in loader:
                continue
            if torch.is_tensor(value) and tuple(value.shape[:2]) != (size, length):
                if key == "attention_mask":  # [batch, 1, seq, seq]
                    value = value[:size, :, :length, :length].contiguous()
                elif key == "position_ids":
                    value = value[:size, :length].contiguous()
            loader[key] = value.to(tokens.device) if torch.is_tensor(value) else value
        return loader

    def _shared_batch(self) -> dict:
        """This step's first micro-batch, on every rank; collective over the tensor-parallel group.

        Megatron-LM's loader reads data on a group's first rank only; the others get its
        micro-batch, as in its forward step. A pipeline stage with neither embedding nor output
        layer may get no data at all. It gets a stand-in of the training shape, the only part of
        the batch it reads."""
        from megatron.core import parallel_state

        batch = self.step_batch
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            box = [batch]
            dist.broadcast_object_list(
                box, src=parallel_state.get_tensor_model_parallel_src_rank(),
                group=parallel_state.get_tensor_model_parallel_group())
            batch = box[0]
        if batch is None:
            shape = (self.args.micro_batch_size, self.args.seq_length)
            batch = {"tokens": torch.zeros(shape, dtype=torch.long),
                     "labels": torch.zeros(shape, dtype=torch.long),
                     "loss_mask": torch.ones(shape)}
        return batch

    # --- after the step ----------------------------------------------------------------------
    def readings(self) -> dict:
        """Adacc's readings for Megatron-LM's log line, in MiB."""
        out = {}
        if self.adacc.activation_bytes is not None:
            out["adacc activation MiB"] = self.adacc.activation_bytes / 2**20
        predicted = self.ready and self.adacc.predicted_activation_bytes
        if predicted:
            out["adacc predicted MiB"] = predicted / 2**20
        return out

    def training_log(self, original, loss_dict, total_loss_dict, learning_rate, iteration,
                     loss_scale, report_memory_flag, skipped_iter, grad_norm, *args, **kwargs):
        for key, value in self.readings().items():
            loss_dict[key] = torch.tensor(float(value))
        loss = _from_last_stage(loss_dict.get("lm loss"))
        self.record.update(
            iteration=iteration,
            loss=loss,
            lr=learning_rate,
            grad_norm=None if skipped_iter else grad_norm,
            tokens_per_s=(self.args.global_batch_size * self.args.seq_length
                          / self.record.get("step_time_s", float("nan"))),
        )
        if self.args.fp16 or self.args.loss_scale:
            self.record.update(loss_scale=float(loss_scale), skipped_iter=int(skipped_iter))
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                        report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)

    def evaluate(self, original, *args, **kwargs):
        result = original(*args, **kwargs)
        losses = result[0] if isinstance(result, tuple) else result
        if isinstance(losses, dict) and "lm loss" in losses:
            self.val_loss = float(losses["lm loss"])
        return result

    def after_step(self, original, model, optimizer, opt_param_scheduler, iteration,
                   *args, **kwargs):
        result = original(model, optimizer, opt_param_scheduler, iteration, *args, **kwargs)
        self.ddp_models, self.optimizer, self.scheduler = model, optimizer, opt_param_scheduler
        # The plan the step ran under; a swap after_step makes applies from the next forward.
        record = {**self.record, **(self.adacc.metrics() if self.ready else {})}
        if self.ready:
            def step_batch():
                # Only on the steps that read it: sharing it over tensor parallelism and moving
                # it to the device each wait for the device.
                if self.adacc.config.tracks:  # the rectifier samples this step's micro-batch
                    self.step_batch = self._shared_batch()
                return batch_tuple(self.step_batch, self.model)

            with _throwaway_passes(model):  # the rectifier's samples run backward too
                record.update(self.adacc.after_step(iteration, step_batch))
        if self.val_loss is not None:
            record["val_loss"], self.val_loss = self.val_loss, None
        self.write(record)
        return result

    # --- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, original, iteration, model, optimizer, opt_param_scheduler,
                        num_floating_point_operations_so_far, checkpointing_context,
                        non_persistent_ckpt=False, *args, **kwargs):
        """Megatron-LM's save, then tracking's state beside it (ADACC_STATE_FILE, rank 0)."""
        from megatron_adacc import policies

        result = original(iteration, model, optimizer, opt_param_scheduler,
                          num_floating_point_operations_so_far, checkpointing_context,
                          non_persistent_ckpt, *args, **kwargs)
        state = self.adacc.state_dict() if self.ready else None
        kept = (not non_persistent_ckpt or self.args.non_persistent_ckpt_type == "global")
        if state is not None and self.args.save and kept and policies.is_rank0():
            base = self._non_persistent_dir(self.args.save) if non_persistent_ckpt else (
                self.args.save)
            directory = self._state_path(base, iteration).parent
            directory.mkdir(parents=True, exist_ok=True)
            written = directory / f".{ADACC_STATE_FILE}.tmp"
            written.write_text(json.dumps(state))
            written.replace(directory / ADACC_STATE_FILE)  # whole or absent
        return result

    def _non_persistent_dir(self, base: str) -> str:
        """Where Megatron-LM keeps global non-persistent checkpoints for ``base``."""
        from megatron.training import checkpointing

        return (self.args.non_persistent_global_ckpt_dir
                or str(Path(base) / checkpointing._NON_PERSISTENT_CKPT_SUBDIR))

    @staticmethod
    def _state_path(base: str, iteration: int) -> Path:
        from megatron.training import checkpointing

        return Path(checkpointing.get_checkpoint_name(base, iteration, return_base_dir=True)
                    ) / ADACC_STATE_FILE

    def _resume_tracking(self) -> None:
        """Tracking's state from the checkpoint --load read, where the saving run tracked.

        That is the state saved with the iteration loaded, persistent or not (Megatron-LM's
        loaded-iteration record names the persistent one even when a newer non-persistent one
        was loaded)."""
        from megatron_adacc import policies

        iteration = self.args.iteration
        if (not self.args.load or self.args.finetune or not iteration or iteration < 1
                or not self.adacc.config.tracks):
            return
        bases = [self.args.load] + ([self._non_persistent_dir(self.args.load)]
                                    if self.args.non_persistent_ckpt_type == "global" else [])
        path = next((path for path in (self._state_path(base, iteration) for base in bases)
                     if path.is_file()), None)
        if path is None:  # saved without tracking
            return
        rank0 = policies.is_rank0()
        try:
            self.adacc.load_state_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as exc:
            if rank0:
                print(f"adacc: warning: {path}: {exc}; tracking starts afresh", flush=True)
            return
        if rank0:
            print(f"adacc: resumed plan {self.adacc.plan_id} and its tracking from {path}",
                  flush=True)

    def write(self, record: dict) -> None:
        """Keep ``record`` and write it to ``--metrics-file``; one with a value still on the
        device waits for the next write (or close), so no step waits for the device."""
        self._write_held()
        if any(isinstance(value, _LateFloat) for value in record.values()):
            self._held = record
        else:
            self._write(record)

    def _write(self, record: dict) -> None:
        from megatron_adacc import policies

        record = {key: float(value) if isinstance(value, _LateFloat) else value
                  for key, value in record.items()}
        self.records.append(record)
        if len(self.records) > 2 * RECORDS_KEPT:  # trimmed now and then, not every step
            del self.records[:-RECORDS_KEPT]
        if not self.args.metrics_file or not policies.is_rank0():
            return
        if self._metrics is None:
            path = Path(self.args.metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = open(path, "a" if self.args.iteration else "w")
        # Strict JSON: NaN and Inf as null.
        self._metrics.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self._metrics.flush()

    def _write_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._write(held)

    def close(self) -> None:
        self._write_held()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


class _PutBack:
    """An iterator over ``rest`` with the items in ``kept`` first, each held until it is taken."""

    def __init__(self, rest, *kept):
        self.rest, self.kept = rest, list(kept)

    def __iter__(self):
        return self

    def __next__(self):
        return self.kept.pop(0) if self.kept else next(self.rest)


class _LateFloat:
    """A device scalar's value, copied to the host without waiting; read once the copy is done.

    Megatron-LM reads its losses on the host only at its log interval: reading one every step
    would make every step wait for the device."""

    def __init__(self, tensor: torch.Tensor):
        self._host = torch.empty((), dtype=torch.float64, pin_memory=True)
        self._host.copy_(tensor.detach().reshape(()), non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def __float__(self) -> float:
        self._copied.synchronize()
        return float(self._host)


def _late_float(tensor: torch.Tensor) -> float | _LateFloat:
    return _LateFloat(tensor) if tensor.is_cuda else float(tensor)


def _from_last_stage(loss) -> float | _LateFloat | None:
    """The step's loss on every stage; only the last pipeline stage computes it.

    Rank 0 writes the metrics file. Collective over the pipeline group. A loss on the device
    stays there until the metrics record is written."""
    from megatron.core import parallel_state

    from megatron_adacc.models import build

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        device = build.collective_device(group)
        box = (torch.full((), math.nan, dtype=torch.float64, device=device) if loss is None
               else loss.detach().to(device, torch.float64).reshape(()))
        dist.broadcast(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=group)
        return _late_float(box)
    return None if loss is None else _late_float(loss)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


@contextlib.contextmanager
def _throwaway_passes(ddp_models):
    """Adacc's own passes (profile, samples, re-timing) within it leave the loop's state alone.

    - Their gradients stay in the buffers the next step clears.
    - A forward step's loss checks (Megatron-LM's ``validate_result``) pass: the rerun state
      machine asserts them outside the loop's forward-backward pass, and the step that follows
      checks its own loss.
    - Megatron-LM's forward step runs the model under a StragglerDetector, which logs a
      traceback for every exception passing through; the profiler ends a pass past the layer it
      measures with one."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    from megatron_adacc.profiling.profiler import MeasuredLayerDone

    machine = get_rerun_state_machine()
    straggler_log = logging.getLogger("megatron.core.utils")

    def not_a_pass_cut_short(record: logging.LogRecord) -> bool:
        return MeasuredLayerDone.__name__ not in record.getMessage()

    with contextlib.ExitStack() as stack:
        for chunk in ddp_models if isinstance(ddp_models, list) else [ddp_models]:
            if hasattr(chunk, "no_sync"):
                stack.enter_context(chunk.no_sync())
        machine.validate_result = lambda *args, **kwargs: None
        stack.callback(vars(machine).pop, "validate_result", None)
        straggler_log.addFilter(not_a_pass_cut_short)
        stack.callback(straggler_log.removeFilter, not_a_pass_cut_short)
        yield


def batch_tuple(batch: dict, model: torch.nn.Module):
    """(tokens, labels, loss mask) of a data-loader micro-batch, on the model's device."""
    device = next(model.parameters()).device
    return tuple(batch[key].to(device) for key in ("tokens", "labels", "loss_mask"))


_session: Session | None = None
# Megatron-LM's training functions install() wraps, in the order of the session's methods
_WRAPPED = ("train_step", "training_log", "evaluate", "post_training_step_callbacks",
            "save_checkpoint_and_time")


def session() -> Session | None:
    """The running ``pretrain``'s Adacc session (None before ``install``)."""
    return _session


def install(model_cfg, args: argparse.Namespace) -> Session:
    """Put Adacc into ``model_cfg`` and Megatron-LM's loop for this run; returns its session."""
    global _session
    from megatron.training import training

    check_args(args)
    _session = current = Session(args)
    # A --spec of the user's stays theirs (check_args refuses it under a policy).
    if args.transformer_impl == "local" and model_cfg.transformer_layer_spec is None:
        model_cfg.transformer_layer_spec = functools.partial(
            layer_spec, args, current.adacc, local_attention(args))
    model_cfg.pre_wrap_hooks.append(current.remember_model)
    for name, method in zip(_WRAPPED, (current.train_step, current.training_log,
                                       current.evaluate, current.after_step,
                                       current.save_checkpoint)):
        original = getattr(training, name)
        original = getattr(original, "__wrapped_by_adacc__", original)
        wrapped = functools.partial(method, original)
        wrapped.__wrapped_by_adacc__ = original
        setattr(training, name, wrapped)
    return current


def release(forget_session: bool = True) -> None:
    """Give Megatron-LM's loop its own functions back, and forget the last run.

    Forgetting lets its model, optimizer and Adacc session be freed; a process that trains again
    needs that, e.g. a benchmark. ``forget_session=False`` keeps ``session()`` for its readers."""
    global _session
    from megatron.training import training

    for name in _WRAPPED:
        function = getattr(training, name)
        setattr(training, name, getattr(function, "__wrapped_by_adacc__", function))
    if forget_session:
        _session = None
