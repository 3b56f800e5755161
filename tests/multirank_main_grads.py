"""Run under torchrun (2 processes) by test_fp16.py: one bf16 step of 8 accumulated
micro-batches per rank; prints, on rank 0, how far the gradient the optimizer steps with is
from an fp64 reduction of the same micro-batches' 16-bit gradients, in units of fp32's
summation error bound."""
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_adacc.models import build as model_lib
from megatron_adacc.training.arguments import parse_args
from megatron_adacc.training.trainer import Trainer
from multirank_engine import main_params

MICRO = 8


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    args = parse_args(sys.argv[1:], world_size=world)
    trainer = Trainer(args)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    # The reference: every micro-batch's 16-bit gradient (autograd.grad leaves .grad and the
    # optimizer's accumulation alone), summed in fp64 over micro-batches and ranks.
    reference = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    magnitude = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for batch in trainer.train_batches.micro_batches(0):
        loss = model_lib.gpt_loss(trainer.model, batch["tokens"], batch["labels"],
                                  batch["loss_mask"])
        for ref, mag, grad in zip(reference, magnitude,
                                  torch.autograd.grad(loss / MICRO, params)):
            ref += grad.double() / world
            mag += grad.double().abs() / world
    for tensor in (*reference, *magnitude):
        dist.all_reduce(tensor)
    stepped, mains = {}, main_params(trainer)

    def capture(*a, **k):  # the inner AdamW's step sees the gradient the update uses
        stepped["grads"] = [mains[p].grad.double() for p in params]

    (inner,) = trainer.optimizer.chained_optimizers
    inner.optimizer.step = capture
    trainer.train_step(0)
    # fp32 summation of n terms errs by at most about n * 2**-24 * sum |term|.
    bound_unit = 2 * MICRO * world * 2.0**-24
    ratio = max(float(((got - ref).abs() / (bound_unit * mag).clamp_min(1e-30)).max())
                for got, ref, mag in zip(stepped["grads"], reference, magnitude))
    if dist.get_rank() == 0:
        print(json.dumps({"micro_batches": trainer.train_batches.num_micro_batches,
                          "error_in_fp32_bounds": ratio}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
