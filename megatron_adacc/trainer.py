"""The training loop behind pretrain_gpt.py: megatron-core GPTModel on megatron-core data,
with gradient accumulation, data parallelism, evaluation, metrics and checkpoints."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_adacc import checkpoint, data, model as model_lib, numerics, policies, rectifier
from megatron_adacc.optimizer import MainParamAdamW
from megatron_adacc.profile_db import ProfileDB
from megatron_adacc.profiler import static_bytes
from megatron_adacc.runtime import ActivationRuler, apply_plan, get_adacc_layer_spec
from megatron_adacc.tokenizers import build_tokenizer


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config(args: argparse.Namespace):
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    recompute = {}
    if args.recompute_granularity:
        recompute = dict(
            recompute_granularity=args.recompute_granularity,
            recompute_method=args.recompute_method if args.recompute_granularity == "full" else None,
            recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
            recompute_modules=args.recompute_modules if args.recompute_granularity == "selective" else None,
        )
    return model_lib.build_transformer_config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        add_bias_linear=not args.disable_bias_linear,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **recompute,
    )


@dataclass
class MetricsLog:
    """One JSON object per iteration (rank 0), mirrored to TensorBoard when asked."""

    path: str | None
    tensorboard_dir: str | None
    append: bool
    records: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self._file = None
        self._tb = None
        if dist.get_rank() != 0:
            return
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if self.append else "w")
        if self.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir)

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self._file:
            # Strict JSON: NaN/Inf as null (bare NaN is rejected by strict readers).
            self._file.write(json.dumps(numerics.json_safe(record), allow_nan=False) + "\n")
            self._file.flush()
        if self._tb:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["iteration"])

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()


class Progress:
    """A progress bar on a terminal, plain log lines otherwise (rank 0 only)."""

    def __init__(self, total: int, start: int, log_interval: int):
        self.enabled = dist.get_rank() == 0
        self.log_interval = max(1, log_interval)
        self.bar = None
        if self.enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True)

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")
        elif record["iteration"] % self.log_interval == 0 or "val_loss" in record:
            line = (f"iter {record['iteration']:6d} | loss {record['loss']:.4f} | "
                    f"lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
                    f"{record['tokens_per_s']:.0f} tokens/s")
            if "val_loss" in record:
                line += f" | val loss {record['val_loss']:.4f}"
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _average_over(group, value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return tensor.item() / dist.get_world_size(group)


class Trainer:
    def __init__(self, args: argparse.Namespace):
        from megatron.core import parallel_state
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.args = args
        model_lib.init_distributed(args.tensor_model_parallel_size)
        model_lib.set_seed(args.seed)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.is_logging_rank = dist.get_rank() == 0

        self.tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        spec = data.DataSpec(args.data_path, args.split, args.train_data_path,
                             args.valid_data_path)
        if not (spec.data_path or spec.train_data_path):
            train_prefix, valid_prefix = self._demo_corpus()
            spec = data.DataSpec(train_data_path=[train_prefix], valid_data_path=[valid_prefix])
        evals = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
        train_set, valid_set = data.build_datasets(
            spec, self.tokenizer, args.seq_length, args.seed,
            train_samples=args.train_iters * args.global_batch_size,
            valid_samples=max(1, evals * args.eval_iters * args.global_batch_size),
        )
        self.train_batches = data.GlobalBatches(
            train_set, args.global_batch_size, args.micro_batch_size, self.dp_rank, self.dp_size)
        self.valid_batches = (data.GlobalBatches(
            valid_set, args.global_batch_size, args.micro_batch_size, self.dp_rank, self.dp_size)
            if valid_set is not None and len(valid_set) else None)

        self.config = transformer_config(args)
        self.vocab_size = padded_vocab_size(
            self.tokenizer.vocab_size, args.make_vocab_size_divisible_by,
            args.tensor_model_parallel_size)
        self.model = model_lib.build_gpt_model(
            self.config, self.vocab_size, args.max_position_embeddings,
            get_adacc_layer_spec() if policies.uses_runtime(args.adacc_policy) else None)
        self.static_bytes = static_bytes(self.model)
        # Profiling (auto) measures the bare model on the first real micro-batch, before any
        # data-parallel wrapper can synchronise its throwaway gradients.
        self.policy = policies.resolve(
            args.adacc_policy, args.adacc_memory_budget, self.model, self.first_micro_batch(),
            db=ProfileDB(args.adacc_profile_db), reprofile=args.adacc_reprofile,
            strict=args.adacc_strict)
        self.plan = self.policy.plan
        if self.is_logging_rank and self.plan is not None:
            print(policies.describe(self.policy), flush=True)
        if self.plan is not None:
            apply_plan(self.model, self.plan, strict=args.adacc_strict)
        self.rectifier = None
        if args.adacc_tracking == "backoff" and self.policy.result is not None:
            self.rectifier = rectifier.Rectifier(
                policies.designated_codecs(self.policy.costs), self.policy.result,
                self.policy.budget_bytes, sites=args.adacc_tracking_sites,
                guard_threshold=args.adacc_guard_threshold,
                reset_fraction=args.adacc_tracking_reset_fraction,
                max_interval=args.adacc_tracking_max_interval, strict=args.adacc_strict)
        self.activation_bytes: dict[str, int] = {}
        self.train_model = self.model
        if self.dp_size > 1:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.model, process_group=self.dp_group)
        self.optimizer = MainParamAdamW(
            self.model, args.lr, args.weight_decay, (args.adam_beta1, args.adam_beta2))
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if args.lr_warmup_iters else args.lr,
            max_lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters,
            lr_decay_steps=args.lr_decay_iters,
            lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay,
            end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters,
            wd_incr_style="constant",
        )
        self.iteration = 0
        if args.load:
            self.iteration, _ = checkpoint.load(args.load, self.model, self.optimizer,
                                                self.scheduler)

    def first_micro_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, labels, loss mask) of this rank's first training micro-batch."""
        first = next(self.train_batches.micro_batches(0))
        return first["tokens"], first["labels"], first["loss_mask"]

    def _demo_corpus(self) -> tuple[str, str]:
        args = self.args
        # Rank 0 tokenises; the others wait, then read the same files.
        if dist.get_rank() == 0:
            prefixes = data.prepare_demo_corpus(args.tokenizer_type, args.vocab_file,
                                                args.merge_file)
        dist.barrier()
        if dist.get_rank() != 0:
            prefixes = data.prepare_demo_corpus(args.tokenizer_type, args.vocab_file,
                                                args.merge_file)
        return prefixes

    def train_step(self, global_index: int, measure: bool = False) -> tuple[float, float]:
        """One optimizer step over a global batch; returns (loss, grad norm). With
        ``measure``, the activation ruler watches the step and ``activation_bytes`` is updated
        (the same ruler for the stock layer, megatron's recompute and every plan)."""
        self.train_model.train()
        self.optimizer.zero_grad()
        micro = self.train_batches.num_micro_batches
        total = 0.0
        ruler = ActivationRuler(self.model, strict=self.args.adacc_strict) if measure else None
        with ruler or _nullcontext():
            for k, batch in enumerate(self.train_batches.micro_batches(global_index)):
                sync = k == micro - 1 or self.dp_size == 1
                with self.train_model.no_sync() if not sync else _nullcontext():
                    loss = model_lib.gpt_loss(self.train_model, batch["tokens"],
                                              batch["labels"], batch["loss_mask"])
                    if ruler is not None:
                        ruler.forward_done()
                    (loss / micro).backward()
                total += loss.item()
        if ruler is not None:
            report = ruler.report()
            self.activation_bytes = {"activation_bytes": report.after_forward_bytes,
                                     "activation_peak_bytes": report.peak_bytes}
        # Megatron-LM's --check-for-nan-in-loss-and-grad, before the weights change.
        grad_norm = self.optimizer.clip_and_step(
            self.args.clip_grad,
            lambda norm: numerics.check_step(global_index + 1, total / micro, norm))
        self.scheduler.step(1)
        return _average_over(self.dp_group, total / micro), grad_norm

    def track(self) -> dict:
        """After a step (its loss already taken), at a tracking iteration: the rectifier
        samples the step's first micro-batch, and its swap is applied before the next
        forward. Returns the metrics; every record carries the tracking time so far."""
        rect = self.rectifier
        record = {}
        if rect.schedule.is_tracking(self.iteration):
            first = next(self.train_batches.micro_batches(self.iteration - 1))
            outcome = rect.observe(self.iteration, self.model,
                                   (first["tokens"], first["labels"], first["loss_mask"]))
            if outcome.infeasible and self.is_logging_rank:
                print(f"adacc: iteration {self.iteration}: warning: {outcome.infeasible}; "
                      "running the plan that overruns it least", flush=True)
            if outcome.swap is not None:
                self.plan = outcome.swap.new.plan
                apply_plan(self.model, self.plan, strict=self.args.adacc_strict)
                self.policy.plan, self.policy.result = self.plan, outcome.swap.new
                if self.is_logging_rank:
                    print(f"adacc: iteration {self.iteration}: plan {outcome.swap.old.plan.plan_id}"
                          f" -> {self.plan.plan_id} ({outcome.swap.reason}, predicted gain "
                          f"{outcome.swap.predicted_gain_s * 1e3:.3f} ms/step): "
                          f"{outcome.swap.changed}", flush=True)
            self.policy.costs = rect.costs  # predictions follow the refreshed payloads
            record = outcome.to_record()
        record["tracking_time_s_total"] = rect.tracking_time_s
        return record

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.valid_batches is None or not self.args.eval_iters:
            return None
        self.model.eval()
        losses = []
        for index in range(self.args.eval_iters):
            for batch in self.valid_batches.micro_batches(index):
                losses.append(model_lib.gpt_loss(self.model, batch["tokens"], batch["labels"],
                                                 batch["loss_mask"]).item())
        self.model.train()
        return _average_over(self.dp_group, sum(losses) / len(losses))

    def train(self) -> list[dict]:
        args = self.args
        last = min(args.train_iters, args.exit_interval or args.train_iters)
        if checkpoint.nothing_to_train(args.load, self.iteration, args.train_iters, last):
            return []
        metrics = MetricsLog(args.metrics_file, args.tensorboard_dir, append=self.iteration > 0)
        progress = Progress(args.train_iters, self.iteration, args.log_interval)
        tokens_per_step = args.global_batch_size * args.seq_length
        try:
            while self.iteration < last:
                lr = self.optimizer.param_groups[0]["lr"]
                # The ruler's hooks cost time, so it watches the first step and one step per
                # --activation-measure-interval; records carry the latest measurement.
                measure = (not self.activation_bytes
                           or self.iteration % args.activation_measure_interval == 0)
                start = time.perf_counter()
                loss, grad_norm = self.train_step(self.iteration, measure)
                elapsed = time.perf_counter() - start
                self.iteration += 1
                record = {
                    "iteration": self.iteration,
                    "loss": loss,
                    "lr": lr,
                    "step_time_s": elapsed,
                    "tokens_per_s": tokens_per_step / elapsed,
                    "grad_norm": grad_norm,
                    **self.activation_bytes,
                    "activation_measured": measure,
                    "static_bytes": self.static_bytes,
                    "budget_bytes": self.policy.budget_bytes,
                    "plan_id": self.policy.plan_id,
                }
                if self.policy.result is not None:
                    record["predicted_activation_bytes"] = policies.predicted_activation_bytes(
                        self.policy.costs, self.policy.result)
                if self.rectifier is not None:
                    record.update(self.track())
                if args.eval_interval and (self.iteration % args.eval_interval == 0
                                           or self.iteration == args.train_iters):
                    val = self.evaluate()
                    if val is not None:
                        record["val_loss"] = val
                metrics.write(record)
                progress.update(record)
                if args.save and ((args.save_interval and self.iteration % args.save_interval == 0)
                                  or self.iteration == last):
                    checkpoint.save(args.save, self.iteration, self.model, self.optimizer,
                                    self.scheduler)
        finally:
            progress.close()
            metrics.close()
        return metrics.records


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
