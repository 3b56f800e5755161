"""The training loop behind pretrain_gpt.py: megatron-core GPTModel on megatron-core data,
with gradient accumulation, data parallelism, evaluation, metrics and checkpoints."""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_adacc import models
from megatron_adacc.profiling import allocator
from megatron_adacc.training import checkpointing
from megatron_adacc.training import data
from megatron_adacc.profiling import hardware
from megatron_adacc.models import build as model_lib
from megatron_adacc.training import numerics
from megatron_adacc.adacc import Adacc, AdaccConfig
from megatron_adacc.models.attention import local_layer_spec, with_attention_backend
from megatron_adacc.training.step_trace import StepTrace
from megatron_adacc.training.tokenizers import build_tokenizer


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config(args: argparse.Namespace):
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
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
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **recompute,
        **models.transformer_config_options(args),
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
            norm = record["grad_norm"]
            line = (f"iter {record['iteration']:6d} | loss {record['loss']:.4f} | "
                    f"lr {record['lr']:.3e} | "
                    f"grad norm {'skipped' if norm is None else f'{norm:.3f}'} | "
                    f"{record['tokens_per_s']:.0f} tokens/s")
            if "loss_scale" in record:
                line += f" | loss scale {record['loss_scale']:g}"
            if "val_loss" in record:
                line += f" | val loss {record['val_loss']:.4f}"
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_data(args: argparse.Namespace, tokenizer, dp_rank: int = 0, dp_size: int = 1
               ) -> tuple[data.GlobalBatches, data.GlobalBatches | None]:
    """(training batches, validation batches or None) of this data-parallel rank, on the
    host: the flags' datasets, or the built-in demo corpus when none is given."""
    spec = data.DataSpec(args.data_path, args.split, args.train_data_path,
                         args.valid_data_path)
    if not (spec.data_path or spec.train_data_path):
        train_prefix, valid_prefix = _demo_corpus(args)
        spec = data.DataSpec(train_data_path=[train_prefix], valid_data_path=[valid_prefix])
    evals = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    train_set, valid_set = data.build_datasets(
        spec, tokenizer, args.seq_length, args.seed,
        train_samples=args.train_iters * args.global_batch_size,
        valid_samples=max(1, evals * args.eval_iters * args.global_batch_size),
    )
    train = data.GlobalBatches(train_set, args.global_batch_size, args.micro_batch_size,
                               dp_rank, dp_size)
    valid = (data.GlobalBatches(valid_set, args.global_batch_size, args.micro_batch_size,
                                dp_rank, dp_size)
             if valid_set is not None and len(valid_set) else None)
    return train, valid


def _demo_corpus(args: argparse.Namespace) -> tuple[str, str]:
    # Rank 0 tokenises; the others wait, then read the same files.
    if dist.get_rank() == 0:
        prefixes = data.prepare_demo_corpus(args.tokenizer_type, args.vocab_file,
                                            args.merge_file)
    dist.barrier()
    if dist.get_rank() != 0:
        prefixes = data.prepare_demo_corpus(args.tokenizer_type, args.vocab_file,
                                            args.merge_file)
    return prefixes


def build_model(args: argparse.Namespace, tokenizer, layer_spec=None) -> torch.nn.Module:
    """The flags' GPTModel (megatron-core's local spec, or ``layer_spec``), its core
    attention the flags' ``--attention-backend``."""
    if args.vocab_size is not None and args.vocab_size < tokenizer.vocab_size:
        from megatron_adacc.training.arguments import ConfigError

        raise ConfigError(f"--vocab-size {args.vocab_size} is smaller than the "
                          f"{args.tokenizer_type} tokenizer's {tokenizer.vocab_size} tokens")
    vocab_size = padded_vocab_size(args.vocab_size or tokenizer.vocab_size,
                                   args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size)
    spec = with_attention_backend(layer_spec or local_layer_spec(), args.attention_backend)
    return model_lib.build_gpt_model(transformer_config(args), vocab_size,
                                     args.max_position_embeddings, spec,
                                     embedding=models.EmbeddingOptions.from_args(args))


def build_model_and_data(args: argparse.Namespace, layer_spec=None
                         ) -> tuple[torch.nn.Module, data.GlobalBatches,
                                    data.GlobalBatches | None]:
    """What every run of the flags starts with: the process groups (a world of one for a
    plain ``python`` run), seeds, then (model, training batches, validation batches or
    None) of this data-parallel rank."""
    from megatron.core import parallel_state

    model_lib.init_distributed(args.tensor_model_parallel_size,
                               args.pipeline_model_parallel_size)
    model_lib.set_seed(args.seed)
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    train, valid = build_data(args, tokenizer, parallel_state.get_data_parallel_rank(),
                              parallel_state.get_data_parallel_world_size())
    model = build_model(args, tokenizer, layer_spec)
    # Every batch (training, evaluation, profiling, tracking) goes where the model lives.
    for batches in (train, valid):
        if batches is not None:
            batches.device = model_device(model)
    return model, train, valid


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def first_micro_batch(batches: data.GlobalBatches) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """(tokens, labels, loss mask) of this rank's first training micro-batch."""
    return _as_tuple(next(batches.micro_batches(0)))


def _as_tuple(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch["tokens"], batch["labels"], batch["loss_mask"]


def _forward_step(data_iterator, model):
    """megatron-core's forward_step_func: one micro-batch through this pipeline stage. The
    loss function (run on the last stage only) follows Megatron-LM's pretrain_gpt: the
    masked loss sum and the token count, which the schedule divides by the tokens and the
    number of micro-batches; the third element, the micro-batch's mean loss, is what the
    trainer reports."""
    batch = next(data_iterator) if data_iterator is not None else None
    first, last = model_lib.pipeline_stage()
    tokens = batch["tokens"] if batch is not None and first else None
    labels = batch["labels"] if batch is not None and last else None
    output = model_lib.gpt_forward(model, tokens, labels)

    def loss_func(per_token: torch.Tensor):
        loss_sum, num_tokens = model_lib.masked_loss_sum(per_token, batch["loss_mask"])
        mean = loss_sum.detach() / num_tokens.clamp(min=1)
        return loss_sum, num_tokens.to(torch.int), mean

    return output, loss_func


def _average_over(group, value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64,
                          device=model_lib.collective_device(group))
    dist.all_reduce(tensor, group=group)
    return tensor.item() / dist.get_world_size(group)


def allocator_record(peaks: allocator.Peaks, device: torch.device) -> dict:
    """The CUDA caching allocator's peaks over one step (none on a CPU)."""
    if device.type != "cuda":
        return {}
    return {"max_memory_allocated": peaks.max_allocated,
            "max_memory_reserved": peaks.max_reserved}


def ddp_config(args: argparse.Namespace):
    """megatron's DistributedDataParallelConfig from Megatron-LM's flags."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )


def optimizer_config(args: argparse.Namespace):
    """megatron's OptimizerConfig from Megatron-LM's flags: Adam (decoupled weight decay,
    AdamW), gradient clipping, loss scaling for fp16 (dynamic unless --loss-scale)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, fp16=args.fp16, bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
    )


def wire_schedule_hooks(model, optimizer, overlap_grad_reduce: bool) -> None:
    """The hooks megatron-core's schedules call, set on the model's config as Megatron-LM's
    training.py sets them: the loss scaled by the optimizer's loss scale (fp16); with overlapped
    reduction, the DDP's no_sync (micro-batches before the last accumulate only) and
    start_grad_sync (the last micro-batch's buckets start reducing as backward fills
    them); and finalize_model_grads, which finishes the reduction (and all-reduces the tied
    embedding between the first and last pipeline stages)."""
    from megatron.core.distributed import finalize_model_grads

    config = model.config
    # Without a loss scaler (fp32, bf16) the scale is 1: multiplying the loss by it would
    # change nothing but keep the scale tensor for backward, bytes no plan counts.
    scalers = [getattr(o, "grad_scaler", None)
               for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    config.grad_scale_func = optimizer.scale_loss if any(scalers) else None
    config.no_sync_func = model.no_sync if overlap_grad_reduce else None
    config.grad_sync_func = model.start_grad_sync if overlap_grad_reduce else None
    config.finalize_model_grads_func = finalize_model_grads


def optimizer_param_scheduler(args: argparse.Namespace, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
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
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


class Trainer:
    def __init__(self, args: argparse.Namespace):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.args = args
        self.step_batch = None  # the first micro-batch of the last step, on stages with data
        self.adacc = Adacc(AdaccConfig.from_args(args))
        self.model, self.train_batches, self.valid_batches = build_model_and_data(
            args, self.adacc.layer_spec())
        self.device = model_device(self.model)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
        # megatron's engine: its DDP (gradient buckets reduced as backward fills them with
        # --overlap-grad-reduce), its optimizer (distributed with
        # --use-distributed-optimizer) and its scheduler, wired as Megatron-LM wires them.
        self.train_model = DistributedDataParallel(self.model.config, ddp_config(args),
                                                   self.model)
        self.optimizer = get_megatron_optimizer(optimizer_config(args), [self.train_model])
        wire_schedule_hooks(self.train_model, self.optimizer, args.overlap_grad_reduce)
        self.forward_backward = get_forward_backward_func()
        self.scheduler = optimizer_param_scheduler(args, self.optimizer)
        self._check_grad_norm_before_step()
        # Profiling (auto) runs throwaway backward passes on the model: under no_sync they
        # only accumulate into the gradient buffers, which the first step clears. Each
        # stage's plan counts the micro-batches 1F1B keeps in flight there, and the bytes
        # the engine holds and its optimizer step adds.
        self.static_bytes = hardware.engine_static_bytes([self.train_model], self.optimizer)
        self.optimizer_step_bytes = hardware.engine_step_bytes(self.optimizer)
        static_bytes, optimizer_step_bytes = self._most_engine_bytes()
        with self.train_model.no_sync():
            self.adacc.setup(self.model, first_micro_batch(self.train_batches),
                             num_micro_batches=self.train_batches.num_micro_batches,
                             static_bytes=static_bytes,
                             optimizer_step_bytes=optimizer_step_bytes)
        self.iteration = 0
        if args.load:
            self.iteration = checkpointing.load(args, [self.train_model], self.optimizer,
                                                self.scheduler)

    def _most_engine_bytes(self) -> tuple[int, int]:
        """The most any data-parallel rank of this stage holds, and adds in its optimizer
        step (the distributed optimizer's shards differ by a few bytes): one budget for
        every rank, so every rank plans alike."""
        most = torch.tensor([self.static_bytes, self.optimizer_step_bytes], dtype=torch.int64,
                            device=model_lib.collective_device(self.dp_group))
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
        static_bytes, optimizer_step_bytes = most.tolist()
        return static_bytes, optimizer_step_bytes

    def _check_grad_norm_before_step(self) -> None:
        """Megatron-LM's --check-for-nan-in-loss-and-grad, before the weights change: the
        step's loss and gradient norm are checked as soon as the optimizer has the norm (an
        fp16 overflow is the exception: loss scaling skips that step first)."""
        grad_norm = self.optimizer.get_grad_norm

        def checked_grad_norm():
            norm = grad_norm()
            numerics.check_step(self.iteration + 1, self._step_loss, norm)
            return norm

        self.optimizer.get_grad_norm = checked_grad_norm

    def _run_schedule(self, batches: data.GlobalBatches, global_index: int, forward_only: bool
                      ) -> list[float]:
        """Every micro-batch of global batch ``global_index`` through megatron-core's
        schedule; returns the micro-batches' mean losses on every rank of the pipeline (the
        last stage computes them). Only the first and last stages read data."""
        first, last = model_lib.pipeline_stage()
        # Built as the schedule asks for them, as megatron's data iterator does: a
        # micro-batch held for the whole step would keep its token ids alive after its
        # backward freed them, and the ruler would count them.
        micro_batches = batches.micro_batches(global_index) if first or last else None
        if micro_batches is not None and not forward_only and self.adacc.rectifier is not None:
            head = next(micro_batches)
            self.step_batch = _as_tuple(head)  # what tracking samples after the step
            micro_batches = itertools.chain([head], micro_batches)
        reported = self.forward_backward(
            forward_step_func=_forward_step,
            data_iterator=micro_batches,
            model=self.train_model,
            num_microbatches=batches.num_micro_batches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )
        if dist.get_world_size(self.pp_group) == 1:
            return [mean.item() for mean in reported]
        means = (torch.stack(reported).double() if last
                 else torch.empty(batches.num_micro_batches, dtype=torch.float64))
        means = means.to(model_lib.collective_device(self.pp_group))
        dist.broadcast(means, src=self.pp_last_rank, group=self.pp_group)
        return means.tolist()

    def train_step(self, global_index: int, measure: bool = False
                   ) -> tuple[float, float | None]:
        """One optimizer step over a global batch; returns (loss, grad norm), the norm None
        when overflowing gradients skipped the step. With ``measure``, the activation ruler
        watches the step (the same ruler for the stock layer, megatron's recompute and
        every plan)."""
        self.train_model.train()
        self.train_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self.adacc.measure(measure):
            means = self._run_schedule(self.train_batches, global_index, forward_only=False)
        self._step_loss = sum(means) / len(means)
        updated, grad_norm, _ = self.optimizer.step()
        if updated:  # megatron's scheduler does not advance on a skipped step
            self.scheduler.step(1)
        return _average_over(self.dp_group, self._step_loss), grad_norm if updated else None

    def _loss_scale_record(self, skipped: bool) -> dict:
        """The loss scale the next step runs with, and whether this one was skipped."""
        if not (self.args.fp16 or self.args.loss_scale):
            return {}
        scale = self.optimizer.get_loss_scale().item()
        if skipped and dist.get_rank() == 0:
            print(f"iteration {self.iteration}: gradients overflowed, step skipped; loss "
                  f"scale now {scale:g}", flush=True)
        return {"loss_scale": scale, "skipped_iter": int(skipped)}

    def _after_step(self) -> dict:
        # The rectifier's samples run backward too: accumulate only, as in profiling.
        with self.train_model.no_sync():
            return self.adacc.after_step(self.iteration, self.step_batch)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.valid_batches is None or not self.args.eval_iters:
            return None
        self.train_model.eval()
        losses = [mean for index in range(self.args.eval_iters)
                  for mean in self._run_schedule(self.valid_batches, index, forward_only=True)]
        self.train_model.train()
        return _average_over(self.dp_group, sum(losses) / len(losses))

    def train(self, between_steps: Callable[[], None] = lambda: None) -> list[dict]:
        """Train to --train-iters (or --exit-interval), calling ``between_steps`` after each
        step (pretrain_gpt.py: raise the interrupt that arrived during it, if it was lost);
        returns the metrics records."""
        args = self.args
        last = min(args.train_iters, args.exit_interval or args.train_iters)
        if checkpointing.nothing_to_train(args.load, self.iteration, args.train_iters, last):
            return []
        metrics = MetricsLog(args.metrics_file, args.tensorboard_dir, append=self.iteration > 0)
        progress = Progress(args.train_iters, self.iteration, args.log_interval)
        tokens_per_step = args.global_batch_size * args.seq_length
        saver = checkpointing.Saver(args)
        trace = StepTrace(args, dist.get_rank(), self.device, self.iteration)
        try:
            while self.iteration < last:
                trace.before_step(self.iteration)
                lr = self.optimizer.param_groups[0]["lr"]
                # The ruler's hooks cost time, so it watches the first step and one step per
                # --activation-measure-interval; records carry the latest measurement.
                measure = (self.adacc.activation_bytes is None
                           or self.iteration % args.activation_measure_interval == 0)
                start = time.perf_counter()
                with allocator.watch(self.device) as peaks:
                    loss, grad_norm = self.train_step(self.iteration, measure)
                elapsed = time.perf_counter() - start
                self.iteration += 1
                trace.after_step(self.iteration)
                record = {
                    "iteration": self.iteration,
                    "loss": loss,
                    "lr": lr,
                    "step_time_s": elapsed,
                    "tokens_per_s": tokens_per_step / elapsed,
                    "grad_norm": grad_norm,
                    **self._loss_scale_record(grad_norm is None),
                    **allocator_record(peaks, self.device),
                    "activation_measured": measure,
                    **self.adacc.metrics(),
                    # After the step's loss is taken: a swap applies from the next forward.
                    **self._after_step(),
                }
                if args.eval_interval and (self.iteration % args.eval_interval == 0
                                           or self.iteration == args.train_iters):
                    val = self.evaluate()
                    if val is not None:
                        record["val_loss"] = val
                metrics.write(record)
                progress.update(record)
                if args.save and ((args.save_interval and self.iteration % args.save_interval == 0)
                                  or self.iteration == last):
                    saver.save(self.iteration, [self.train_model], self.optimizer,
                               self.scheduler)
                saver.poll()
                between_steps()
        finally:
            trace.close()
            saver.finish()
            progress.close()
            metrics.close()
        return metrics.records
