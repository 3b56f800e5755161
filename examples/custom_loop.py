"""Adacc in your own loop: a plain megatron-core training loop that adopts Adacc's auto policy.

The loop builds a GPTModel from megatron-core's local layer spec and trains it with AdamW on a
synthetic batch and the language-model loss, under a memory budget. The lines marked ``# adacc`` are
all it takes.

    python examples/custom_loop.py --memory-budget 4MiB --metrics-file runs/custom.jsonl

Without --memory-budget it trains with megatron's stock layer. Runs on a CPU (gloo) or a GPU.
"""
import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from megatron_adacc import Adacc, AdaccConfig  # adacc
from megatron_adacc import megatron_compat  # megatron-core 0.19.2 on a CPU (no-op on a GPU)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-budget", help="e.g. 4MiB: train with Adacc auto under it")
    parser.add_argument("--metrics-file", help="one JSON object per iteration")
    parser.add_argument("--profile-db", help="Adacc's ProfileDB (default in ~/.cache)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    return parser.parse_args()


def init_process_group():
    megatron_compat.apply()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:  # a plain `python` run: a world of one on a free port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def synthetic_batch(step, args, device):
    """Counting sequences from a random start: next-token prediction the model can learn."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, args.vocab, (args.micro_batch, 1), generator=gen)
    tokens = (start + torch.arange(args.seq + 1)) % args.vocab
    loss_mask = torch.ones(args.micro_batch, args.seq)
    return tuple(t.to(device) for t in (tokens[:, :-1], tokens[:, 1:], loss_mask))


def lm_loss(model, batch):
    tokens, labels, loss_mask = batch
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    per_token = model(tokens, positions, None, labels=labels)
    return (per_token.float() * loss_mask).sum() / loss_mask.sum()


def main():
    args = parse_args()
    init_process_group()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        hidden_dropout=0.1, attention_dropout=0.1, use_cpu_initialization=device.type == "cpu",
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False)
    adacc = Adacc(AdaccConfig(policy="auto" if args.memory_budget else "none",  # adacc
                              memory_budget=args.memory_budget,  # adacc
                              profile_db=args.profile_db))  # adacc
    model = GPTModel(config, adacc.layer_spec(), vocab_size=args.vocab,  # adacc: the spec
                     max_sequence_length=args.seq,
                     position_embedding_type="learned_absolute").to(device)
    adacc.setup(model, synthetic_batch(1, args, device), lm_loss)  # adacc: step 1's batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    metrics = open(args.metrics_file, "w") if args.metrics_file else None
    for step in range(1, args.iters + 1):
        batch = synthetic_batch(step, args, device)
        optimizer.zero_grad()
        with adacc.measure(step % 10 == 1):  # adacc: every step timed, the ruler now and then
            loss = lm_loss(model, batch)
            loss.backward()
        optimizer.step()
        record = {"iteration": step, "loss": loss.item()}
        record.update(adacc.metrics())  # adacc: activation_bytes, plan_id, ...
        record.update(adacc.after_step(step, batch))  # adacc: tracking, plan swaps
        if metrics:
            metrics.write(json.dumps(record) + "\n")
        if step % 10 == 0:
            print(f"iter {step:4d} | loss {record['loss']:.4f} | plan {record['plan_id']}")
    if metrics:
        metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
