"""Run under torchrun (2 processes) by test_fp16.py: one bf16 step of 8 accumulated
micro-batches per rank through pretrain_gpt.py (Megatron-LM's loop, in this process);
prints, on rank 0, how far the gradient the optimizer steps with is from an fp64 reduction
of the same micro-batches' 16-bit gradients, in units of fp32's summation error bound.

argv: pretrain_gpt.py's flags (after helpers.pretrain.TINY)."""
import json
import sys

import torch
import torch.distributed as dist

import pretrain_gpt
from megatron_adacc import Adacc, megatron_lm
from megatron_adacc.models import build as model_lib
from helpers.engine import inner_optimizers, main_params
from helpers.pretrain import pretrain

MICRO = 8


def main() -> None:
    model_lib.init_distributed(1)  # the script's group: the run leaves it for the report
    world = dist.get_world_size()
    batches, verdict = [], {}
    on_host = pretrain_gpt._batch_on_host

    def recorded(*args):  # every micro-batch the loop's forward_step takes
        batch = on_host(*args)
        batches.append({key: value.clone() for key, value in batch.items()
                        if torch.is_tensor(value)})
        return batch

    pretrain_gpt._batch_on_host = recorded
    real_setup = Adacc.setup

    def setup(adacc, *args, **kwargs):
        result = real_setup(adacc, *args, **kwargs)
        session = megatron_lm.session()
        model, mains = adacc.model, main_params(session.optimizer)
        params = [p for p in model.parameters() if p.requires_grad]

        def capture(*a, **k):  # the inner AdamW's step sees the gradient the update uses
            # The reference: every micro-batch's 16-bit gradient (autograd.grad leaves the
            # engine's accumulation alone), summed in fp64 over micro-batches and ranks.
            reference = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
            magnitude = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
            for batch in batches:
                with torch.enable_grad():  # megatron's optimizer steps under no_grad
                    loss = model_lib.gpt_loss(model, batch["tokens"], batch["labels"],
                                              batch["loss_mask"])
                    grads = torch.autograd.grad(loss / MICRO, params)
                for ref, mag, grad in zip(reference, magnitude, grads):
                    ref += grad.double() / world
                    mag += grad.double().abs() / world
            for tensor in (*reference, *magnitude):
                dist.all_reduce(tensor)
            bound_unit = 2 * MICRO * world * 2.0**-24
            verdict["micro_batches"] = len(batches)
            verdict["error_in_fp32_bounds"] = max(
                float(((mains[p].grad.double() - ref).abs()
                       / (bound_unit * mag).clamp_min(1e-30)).max())
                for p, ref, mag in zip(params, reference, magnitude))

        for inner in inner_optimizers(session.optimizer):
            inner.optimizer.step = capture
        return result

    Adacc.setup = setup
    pretrain(*sys.argv[1:])
    if dist.get_rank() == 0:
        print(json.dumps(verdict))
    dist.barrier()
    model_lib.shutdown_distributed()


if __name__ == "__main__":
    main()
