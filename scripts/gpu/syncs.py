"""(b) Host synchronisations in a training step; exact plans bitwise against megatron's layer."""
from __future__ import annotations

import warnings

import torch

from gpu.common import (FLOAT_DTYPES, SYNC_MODEL_S, SYNC_WARNING, Deadline, Sizes, bits_of,
                        device_kind, synchronize)

VOCAB, BATCH, STEPS = 1024, 2, 2


def _own_sites(family: str) -> list:
    from megatron_adacc import models
    from megatron_adacc.common.sites import SITES

    return [SITES[name] for name in models.get(family).sites]


def _exact_plans(family: str) -> dict:
    from megatron_adacc.common.plan import Plan

    own = _own_sites(family)
    return {
        "retain": Plan(),
        "recompute attention": Plan.uniform(
            {s.name: "recompute" for s in own if s.segment == "attention" and s.recomputable}),
        "recompute mlp": Plan.uniform(
            {s.name: "recompute" for s in own if s.segment == "mlp" and s.recomputable}),
        "recompute all": Plan.uniform({s.name: "recompute" for s in own if s.recomputable}),
    }


def every_codec_plan(family: str, backend: str):
    """A plan compressing one site of the family's layer with each codec one of its sites takes.

    The site is the first such one, in the layer's order. It also returns the codecs no site
    takes."""
    from megatron_adacc import codecs, models
    from megatron_adacc.common.plan import Decision, Plan
    from megatron_adacc.common.sites import COMPRESS

    saved = set(models.get(family).sites)
    if backend == "flash":  # SDPA saves none of the unfused attention's s^2 sites
        saved -= {"softmax_out", "attn_dropout_mask", "attn_probs", "attn_mask"}
    sites = [s for s in _own_sites(family) if s.name in saved and s.default_codec
             and not s.shared]
    chosen, missing = {}, []
    for codec in codecs.NAMES:
        site = next((s for s in sites if s.takes(codec) and s.name not in chosen), None)
        if site is None:
            missing.append(codec)
        else:
            chosen[site.name] = Decision(COMPRESS, codec)
    return Plan.uniform(chosen), missing


def _tiny_model(family: str, attention_backend: str, dtype, plan, device, dropout: float,
                sizes: Sizes):
    from megatron_adacc import models
    from megatron_adacc.models import build as model_lib
    from megatron_adacc.models.attention import local_layer_spec
    from megatron_adacc.runtime import apply_plan, get_adacc_layer_spec

    model_lib.set_seed(1)
    options = models.get(family).transformer_config_options(sizes.sync_hidden,
                                                             num_query_groups=4)
    options.update(hidden_dropout=dropout, attention_dropout=dropout)
    config = model_lib.build_transformer_config(
        num_layers=2, hidden_size=sizes.sync_hidden, num_attention_heads=8,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, params_dtype=dtype, **options)
    spec = (local_layer_spec(attention_backend) if plan is None
            else get_adacc_layer_spec(attention_backend))
    model = model_lib.build_gpt_model(config, VOCAB, sizes.sync_seq, spec, attention_backend,
                                      embedding=models.get(family).embedding_options())
    model = model.to(device=device, dtype=dtype)
    if plan is not None:
        apply_plan(model, plan, strict=True)
    return model


def _batch(step: int, device, sizes: Sizes):
    gen = torch.Generator(device=device).manual_seed(step)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, sizes.sync_seq), generator=gen,
                                    device=device)
                      for _ in range(2))
    return tokens, labels, torch.ones_like(tokens)


def _train(model, device, sizes: Sizes) -> tuple[list, list, list]:
    """Losses, gradients and host synchronisations of each of STEPS steps, on fixed batches.

    Both sync counts (CUDA's, the ops') are kept, and dropout streams are fixed too."""
    from megatron_adacc.models import build as model_lib
    from megatron_adacc.profiling.syncs import SyncCounter

    # Plain SGD: Adam's eps underflows in fp16 and turns untouched parameters into NaN.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses, grads, syncs = [], [], []
    for step in range(STEPS):
        batch = _batch(step, device, sizes)
        optimizer.zero_grad()
        model_lib.set_seed(100 + step)
        synchronize(device)
        with warnings.catch_warnings(record=True) as caught, SyncCounter() as ops:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = model_lib.gpt_loss(model, *batch)
                loss.backward()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        cuda_count = (sum(SYNC_WARNING in str(w.message) for w in caught)
                      if device.type == "cuda" else None)
        syncs.append((cuda_count, ops.total, dict(ops.counts)))
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        optimizer.step()
    return losses, grads, syncs


def _auto_plan(family: str, backend: str, dtype_name: str, dropout: float):
    """auto's plan for a 2-layer model of the family, hidden and sequence 1024, where it compresses.

    The budget is a tenth of the way from its smallest feasible budget to no optimisation's peak,
    where it compresses and recomputes. It is planned from the analytic model. A sync count needs
    only which sites take which action, and a profile would cost seconds a model. The small
    models run it, since their sites are the same."""
    from megatron_adacc import models, policies
    from megatron_adacc.planning import analytic, minimum_budget

    flags = {**models.get(family).flags, "num-layers": 2, "hidden-size": 1024,
             "num-attention-heads": 8, "seq-length": 1024, "vocab-size": VOCAB,
             "attention-backend": backend, "hidden-dropout": dropout,
             "attention-dropout": dropout, dtype_name: True}
    if models.get(family).flags.get("group-query-attention"):
        flags["num-query-groups"] = 4
    costs = analytic.analytic_costs(analytic.ModelShape.from_flags(flags), BATCH, "h100-80gb")
    smallest = minimum_budget(costs, allow_lossy_sources=False)
    loosest = policies.plan("auto", costs, 1 << 50, allow_lossy_sources=False).peak_bytes
    return policies.plan("auto", costs, smallest + (loosest - smallest) // 10,
                         allow_lossy_sources=False).plan


def _small_models(device, sizes: Sizes, deadline: Deadline, skipped: list):
    """(name, family, attention, dtype name, dropout) of each small model, while time allows one.

    Those left out are added to ``skipped``."""
    for dtype_name in sizes.sync_dtypes:
        for family, backend in sizes.sync_models:
            name = f"{family} {backend} {dtype_name}"
            if deadline.left() < SYNC_MODEL_S[device_kind(device.type == "cpu")] * 5:
                skipped.append(name)
                continue
            # SDPA's CPU flash kernel takes no dropout
            yield name, family, backend, dtype_name, (
                0.0 if backend == "flash" and device.type == "cpu" else 0.1)


def syncs_worker(device, sizes: Sizes, deadline: Deadline, emit) -> None:
    from megatron_adacc import policies
    from megatron_adacc.models import build as model_lib

    model_lib.init_distributed(1)
    report = {"counter": ("CUDA sync debug mode and syncing ATen ops" if device.type == "cuda"
                          else "syncing ATen ops (no CUDA here)"),
              "rows": [], "missing_codecs": {}, "skipped": [], "exactness": None}
    for model_name, family, backend, dtype_name, dropout in _small_models(
            device, sizes, deadline, report["skipped"]):
        dtype = FLOAT_DTYPES[dtype_name]
        every, missing = every_codec_plan(family, backend)
        report["missing_codecs"][model_name] = missing
        plans = {"none": None, "full-recompute": policies.full_recompute_plan(),
                 "quantize": policies.quantize_plan()}
        try:
            plans["auto"] = _auto_plan(family, backend, dtype_name, dropout)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            report["rows"].append({"model": model_name, "policy": "auto",
                                   "error": f"{type(exc).__name__}: {exc}"[:200]})
        plans["every codec"] = every
        stock = None
        for policy, plan in plans.items():
            try:
                counts = _train(_tiny_model(family, backend, dtype, plan, device, dropout,
                                            sizes), device, sizes)[2][-1]
            except Exception as exc:  # noqa: BLE001 - reported in the table
                report["rows"].append({"model": model_name, "policy": policy,
                                       "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            cuda_count, op_count, by_op = counts
            if policy == "none":
                stock = counts
            report["rows"].append({
                "model": model_name, "policy": policy, "cuda_syncs": cuda_count,
                "sync_ops": op_count, "by_op": by_op,
                "added_cuda": (None if stock is None or cuda_count is None
                               else cuda_count - stock[0]),
                "added_ops": None if stock is None else op_count - stock[1]})
            emit(report)
    report["exactness"] = check_exactness(device, sizes, deadline)
    emit(report)


def check_exactness(device, sizes: Sizes, deadline: Deadline) -> dict:
    """Retain and recompute plans against megatron's stock layer, bitwise, with dropout on.

    It compares the losses and gradients of STEPS steps. Configurations are cut when time runs
    out."""
    # warn_only: an op without a deterministic kernel shows up as a mismatch, not a crash.
    torch.use_deterministic_algorithms(True, warn_only=True)
    results = {"configurations": 0, "skipped": [], "mismatches": []}
    try:
        for model, family, backend, dtype_name, dropout in _small_models(
                device, sizes, deadline, results["skipped"]):
            dtype = FLOAT_DTYPES[dtype_name]
            stock_losses, stock_grads, _ = _train(
                _tiny_model(family, backend, dtype, None, device, dropout, sizes), device,
                sizes)
            for name, plan in _exact_plans(family).items():
                losses, grads, _ = _train(
                    _tiny_model(family, backend, dtype, plan, device, dropout, sizes),
                    device, sizes)
                results["configurations"] += 1
                for step in range(STEPS):
                    # Bits, not values: NaN must match NaN where the stock layer made one.
                    if not torch.equal(bits_of(losses[step]), bits_of(stock_losses[step])):
                        results["mismatches"].append(f"{model} {name}: step {step} loss")
                    results["mismatches"] += [
                        f"{model} {name}: step {step} gradient of {param}"
                        for param, grad in stock_grads[step].items()
                        if not torch.equal(bits_of(grads[step][param]), bits_of(grad))]
    finally:
        torch.use_deterministic_algorithms(False)
    results["ok"] = not results["mismatches"]
    return results


