"""Each patch in megatron_compat exists because megatron-core 0.19.2 fails without it.

These tests run the *unpatched* megatron-core in a fresh interpreter and assert the failure
is still there: when one of them fails, megatron-core has fixed the problem and the patch
should be deleted. A probe records how its call failed, so that one failing for another
reason (an API the probe calls has changed) is told apart from the defect.
"""
import json
import subprocess
import sys
import types

import pytest
import torch

PROBE = r"""
import json, re, warnings
warnings.filterwarnings("ignore")
import torch
results = {}

def probe(name, fn):
    # "cuda": it reached for CUDA (no driver, or a CPU build of torch); else how it failed.
    try:
        fn()
        results[name] = "ok"
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        results[name] = "cuda" if re.search("cuda|nvidia", text, re.IGNORECASE) else text

from megatron.core.utils import GlobalMemoryBuffer
probe("cpu_global_memory_buffer",
      lambda: GlobalMemoryBuffer().get_tensor((2, 2), torch.float32, "probe"))

from megatron.core.tensor_parallel.random import CudaRNGStatesTracker, CheckpointWithoutOutput
probe("cpu_rng_tracker", lambda: CudaRNGStatesTracker().add("probe", 1))

from megatron.core.transformer.utils import get_default_causal_mask
results["cached_causal_mask"] = "ok" if hasattr(get_default_causal_mask, "cache_info") else "defect"

from megatron.core.optimizer.grad_scaler import DynamicGradScaler
probe("cpu_grad_scaler", lambda: DynamicGradScaler(2.0**32, 1.0, 2.0, 0.5, 1000, 2))

results["checkpoint_without_output_fp8"] = (
    "defect" if CheckpointWithoutOutput(fp8=False).fp8 else "ok")

# Pipeline parallelism, in a world of one.
import socket, types
import torch.distributed as dist
from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.enums import ModelType
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)

class Stage(torch.nn.Module):
    config = ModelParallelConfig()
    model_type = ModelType.encoder_or_decoder
    def set_input_tensor(self, tensors):
        pass

from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
probe("cpu_pipeline_schedules", lambda: forward_backward_no_pipelining(
    forward_step_func=lambda data, model: (torch.ones(1), None), data_iterator=iter([None]),
    model=Stage(), num_microbatches=1, seq_length=1, micro_batch_size=1, forward_only=True))

# The p2p communicator's receive buffer and its synchronize after batched p2p; the
# communication itself is left out (in a world of one it would wait for itself).
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
dist.batch_isend_irecv = lambda ops: []
communicator = P2PCommunicator(dist.group.WORLD, ModelParallelConfig(pipeline_dtype=torch.float32))
probe("cpu_pipeline_p2p", lambda: communicator.recv_forward((1, 1, 1), is_first_stage=False))

# The last stage's copy of the tied word embedding, copied from the first stage's.
from megatron.core.models.common.language_module.language_module import LanguageModule
weight = torch.nn.Parameter(torch.ones(2, 2))
last_stage = types.SimpleNamespace(
    pre_process=False, post_process=True, share_embeddings_and_output_weights=True,
    output_layer=types.SimpleNamespace(weight=weight), vp_stage=None, vp_size=None,
    pp_group=types.SimpleNamespace(rank=lambda: 1, size=lambda: 2), embd_group=dist.group.WORLD,
    config=types.SimpleNamespace(pipeline_model_parallel_size=2, use_mup=False,
                                  init_model_with_meta_device=False),
    shared_embedding_or_output_weight=lambda: weight, _is_in_embd_group=lambda: True)
probe("cpu_shared_embedding",
      lambda: LanguageModule.setup_embeddings_and_output_layer(last_stage))

# RoPE's frequencies, moved to CUDA at the first forward.
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
probe("cpu_rotary_embedding", lambda: RotaryEmbedding(
    kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True).get_emb(8))
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
probe("cpu_rotary_embedding_yarn", lambda: YarnRotaryEmbedding(
    kv_channels=16, use_cpu_initialization=True).get_emb(8))

# Sequence parallelism's gathers and scatters allocate on CUDA; they return early in a world
# of one, so their source is read.
import inspect
from megatron.core.tensor_parallel import layers, mappings
results["cpu_sequence_parallel"] = (
    "defect" if "device=torch.cuda.current_device()" in inspect.getsource(mappings)
    + inspect.getsource(layers.LinearWithGradAccumulationAndAsyncCommunication) else "ok")

# megatron's engine: DDP's gradient buffer, the optimizer's tensors and type checks, and
# dist_checkpointing's writer.
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig
probe("cpu_grad_buffers", lambda: DistributedDataParallel(
    TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1),
    DistributedDataParallelConfig(), torch.nn.Linear(2, 2)))

# Since 0.19 every gradient sync first makes the current CUDA stream wait for CUDA graphs.
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
probe("cpu_grad_sync", lambda: _ParamAndGradBucketGroup.start_grad_sync(types.SimpleNamespace(
    is_first_batch=False, grad_reduce_handle=None, previous_grad_reduce_bucket_group=None,
    buckets=[])))

from megatron.core.optimizer import clip_grads
probe("cpu_optimizer", lambda: clip_grads.get_grad_norm_fp32([torch.ones(2)]))

# Without apex or Transformer Engine the gradient norm (and --log-params-norm's) is megatron's
# fallback, which reads each tensor's norm on the host: on meta tensors the read fails.
def reads_the_host(impl):
    try:
        impl(0, None, [[torch.ones(2, device="meta")] * 3], False)
    except RuntimeError as exc:
        return "defect" if "meta" in str(exc) else str(exc)
    return "ok"
results["grad_norm_on_the_device"] = reads_the_host(clip_grads.l2_norm_impl)
from megatron.training.utils import common_utils
results["params_norm_on_the_device"] = reads_the_host(common_utils.multi_tensor_l2norm)
graded = torch.nn.Parameter(torch.ones(2))
graded.grad = torch.ones(2)
probe("cpu_optimizer_type_names",
      lambda: clip_grads.clip_grad_by_total_norm_fp32([graded], max_norm=1.0, total_norm=2.0))

import tempfile
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
probe("cpu_dist_checkpointing", lambda: dist_checkpointing.save(
    {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tempfile.mkdtemp()))

# Mixture of experts: the router moves its weight to CUDA at its first forward; the all-to-all
# dispatcher makes a CUDA stream for its copies to the host (its source is read).
import inspect
from megatron.core.transformer.moe import router, token_dispatcher
probe("cpu_moe", lambda: router.Router.gating(types.SimpleNamespace(
    weight=torch.ones(2, 2), bias=None, config=types.SimpleNamespace(moe_router_dtype=None)),
    torch.ones(1, 2)))
results["cpu_moe_dispatcher"] = "defect" if "torch.cuda.Stream()" in inspect.getsource(
    token_dispatcher.MoEAlltoAllTokenDispatcher.__init__) else "ok"
# ... and gives all_to_all_single its split sizes as numpy arrays only from a CUDA tensor.
results["cpu_moe_splits"] = "defect" if "tensor.is_cuda" in inspect.getsource(
    token_dispatcher.maybe_move_tensor_to_cpu) else "ok"

# Attention variants: the sliding window's mask is made on CUDA, a softmax offset too (source).
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.utils import get_sliding_window_causal_mask
probe("cpu_attention_variants", lambda: get_sliding_window_causal_mask(4, 4, (1, 0)))
results["cpu_attention_offset"] = "defect" if "device=torch.cuda.current_device()" in (
    inspect.getsource(DotProductAttention.__init__)) else "ok"

# Local experts with biases add them in place to linear_fc2's output, which autograd forbids
# when the tensor-parallel reduction returns its input: megatron_lm.check_args refuses them.
from megatron.core.transformer.mlp import MLP
results["biased_local_experts"] = (
    "defect" if "output += output_bias.unsqueeze(0)" in inspect.getsource(MLP.forward)
    else "ok")

# Experts under tensor parallelism refuse to train without sequence parallelism, in the first
# forward: megatron_lm.check_args refuses the flags.
from megatron.core.transformer.moe import moe_layer
results["experts_tp_without_sp"] = (
    "defect" if "without also enabling sequence parallelism" in inspect.getsource(moe_layer)
    else "ok")

# Multi-latent attention hands the local core attention a k_channels it does not take:
# megatron_lm.check_args refuses MLA under --transformer-impl local.
results["mla_on_local_attention"] = (
    "defect" if "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    else "ok")

# Meta-device weights are materialised uninitialised outside FSDP: launch.parse refuses the flag.
from megatron.training import training
results["meta_init_without_fsdp"] = (
    "defect" if "torch.empty_like(tensor, device=device)" in inspect.getsource(
        training.to_empty_if_meta_device) else "ok")

# torch's Adam under the distributed optimizer: a fresh optimizer has no single step, and
# a loaded step is one tensor for every parameter.
import inspect
from megatron.core.optimizer import distrib_optimizer
results["distributed_optimizer_with_torch_adam"] = (
    "defect" if not distrib_optimizer.HAVE_APEX_OR_TE
    and "assert len(steps) == 1" in inspect.getsource(
        distrib_optimizer.DistributedOptimizer.state_dict)
    and 's["step"] = step\n' in inspect.getsource(
        distrib_optimizer.DistributedOptimizer.load_state_dict)
    else "ok")

print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def unpatched():
    if torch.cuda.is_available():
        pytest.skip("the CPU shims are only applied without CUDA")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# How a probe fails that does not reach for CUDA: clip_grad_by_total_norm_fp32 asserts (with
# no message) that each gradient is a torch.cuda.FloatTensor; sequence parallelism's source
# is read.
SHIM_FAILURES = {"cpu_optimizer_type_names": "AssertionError: ",
                 "cpu_sequence_parallel": "defect", "cpu_moe_dispatcher": "defect",
                 "cpu_moe_splits": "defect", "cpu_attention_offset": "defect"}


@pytest.mark.parametrize("shim", ["cpu_global_memory_buffer", "cpu_rng_tracker",
                                  "cpu_grad_scaler", "cpu_pipeline_schedules",
                                  "cpu_pipeline_p2p", "cpu_shared_embedding",
                                   "cpu_rotary_embedding", "cpu_sequence_parallel",
                                  "cpu_grad_buffers", "cpu_grad_sync", "cpu_optimizer",
                                  "cpu_optimizer_type_names", "cpu_dist_checkpointing",
                                  "cpu_moe", "cpu_moe_dispatcher", "cpu_moe_splits",
                                  "cpu_attention_variants",
                                  "cpu_attention_offset", "cpu_rotary_embedding_yarn"])
def test_cpu_shim_is_still_needed(unpatched, shim):
    # cpu_pipeline_schedules and cpu_pipeline_p2p are one patch (both modules' CUDA
    # placements), probed separately: it goes when neither needs it; so are cpu_grad_buffers
    # and cpu_grad_sync, cpu_moe and its dispatcher, cpu_attention_variants and the offset,
    # cpu_rotary_embedding and its YaRN.
    assert unpatched[shim] != "ok", f"megatron-core no longer needs {shim}: delete it"
    assert unpatched[shim] == SHIM_FAILURES.get(shim, "cuda"), (
        f"the probe of {shim} no longer reaches the defect")


# Defects of megatron-core a patch or a one-line refusal works around, each with what to do
# once megatron-core fixes it.
DEFECTS = {
    "checkpoint_without_output_fp8": "delete its patch",
    "distributed_optimizer_with_torch_adam": "delete its patch",
    "cached_causal_mask": "delete its patch",
    "grad_norm_on_the_device": "delete its patch",
    "params_norm_on_the_device": "delete its patch",
    "biased_local_experts": "drop the refusal of --num-experts with biases in "
                            "megatron_lm.check_args",
    "experts_tp_without_sp": "drop the refusal of experts under tensor parallelism alone in "
                             "megatron_lm.check_args",
    "mla_on_local_attention": "drop the refusal of --multi-latent-attention in "
                              "megatron_lm.check_args",
    "meta_init_without_fsdp": "drop launch.parse's refusal of --init-model-with-meta-device",
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_defect_is_still_present(unpatched, defect):
    assert unpatched[defect] == "defect", f"megatron-core fixed {defect}: {DEFECTS[defect]}"


def test_causal_mask_is_cached_with_cuda_too():
    # Uncached, every layer saves its own fresh mask on CUDA, which the runtime (recognising
    # the shared attn_mask by identity) cannot attribute. CUDA is faked in a fresh interpreter;
    # the mask is never built there.
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from megatron_adacc import megatron_compat\n"
            "from megatron.core.fusions import fused_softmax\n"
            "print(megatron_compat.apply(), hasattr(fused_softmax.get_default_causal_mask, "
            "'cache_info'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == ("['checkpoint_without_output_fp8', 'cached_causal_mask', "
                   "'distributed_optimizer_with_torch_adam', 'grad_norm_on_the_device'] True")


def test_the_gradient_norm_stays_on_the_device_and_is_megatrons():
    # megatron's fallback builds torch.tensor() from every gradient's norm: a copy to the host
    # per parameter on a GPU. The patch's norm runs on meta tensors, so it reads nothing.
    from megatron.core.optimizer import clip_grads

    from megatron_adacc import megatron_compat

    megatron_compat.apply()
    norm = megatron_compat._l2_norm_on_the_device
    assert clip_grads.l2_norm_impl is norm
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=generator) * n for n in (3, 100, 4097)]
    megatrons = torch.norm(torch.tensor([[torch.norm(grad) for grad in grads]]))
    got, _ = norm(0, None, [grads], False)
    assert got.shape == (1,) and got.dtype == torch.float32
    assert got.item() == megatrons.item()
    on_meta, _ = norm(0, None, [[grad.to("meta") for grad in grads]], False)
    assert on_meta.device.type == "meta" and on_meta.shape == (1,)
    assert norm(0, None, [[]], False)[0].tolist() == [0.0]


def test_patched_megatron_runs_the_shimmed_paths():
    from megatron_adacc import megatron_compat

    applied = megatron_compat.apply()
    # imported after apply(): a name bound before patching keeps the original function
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput, CudaRNGStatesTracker
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

    assert {"cpu_global_memory_buffer", "cpu_rng_tracker", "cached_causal_mask",
            "cpu_grad_scaler", "cpu_pipeline_schedules", "cpu_shared_embedding",
            "cpu_grad_buffers", "cpu_optimizer", "cpu_dist_checkpointing",
            "checkpoint_without_output_fp8"} <= set(applied)
    assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t").shape == (2, 3)
    mask = get_default_causal_mask(3)
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert get_default_causal_mask(3) is mask  # one mask for every layer
    assert CheckpointWithoutOutput(fp8=False).fp8 is False

    tracker = CudaRNGStatesTracker()
    tracker.add("a", 7)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    # forking leaves the default stream alone ...
    assert torch.equal(torch.get_rng_state(), before)
    # ... and the forked stream continues where it left off
    torch.manual_seed(7)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))


def test_the_sliding_window_mask_on_the_host_is_megatrons():
    from megatron_adacc import megatron_compat

    megatron_compat.apply()
    from megatron.core.fusions import fused_softmax

    # True is masked: a window of (1, 0) sees the query's own key and the one before it.
    assert fused_softmax.get_sliding_window_causal_mask(4, 4, (1, 0)).tolist() == [
        [False, True, True, True], [False, False, True, True], [True, False, False, True],
        [True, True, False, False]]


def test_patched_grad_scalers_keep_megatrons_arithmetic_on_the_host():
    from megatron_adacc import megatron_compat

    megatron_compat.apply()
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    scaler = DynamicGradScaler(1024.0, 256.0, 2.0, 0.5, growth_interval=2, hysteresis=1)
    assert scaler.scale.device.type == "cpu"
    scaler.update(True)
    scaler.update(True)
    scaler.update(True)  # floored at min_scale
    assert scaler.scale.item() == 256.0 and scaler.inv_scale.item() == 1 / 256
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale.item() == 512.0
    restored = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, growth_interval=2, hysteresis=1)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale.item() == 512.0 and restored.scale.device.type == "cpu"
    assert ConstantGradScaler(4.0).scale.item() == 4.0


def test_patched_ddp_reduces_gradients_on_the_host(distributed):
    # Construction (the buffers) and finish_grad_sync (the gradient sync, waiting on the
    # current stream since 0.19) on the host, in a world of one: main_grad is the gradient.
    from megatron_adacc import megatron_compat

    megatron_compat.apply()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    module = torch.nn.Linear(2, 2)
    model = DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1),
        DistributedDataParallelConfig(), module)
    model(torch.ones(3, 2)).sum().backward()
    model.finish_grad_sync()
    assert module.weight.main_grad.device.type == "cpu"
    assert torch.equal(module.weight.main_grad, torch.full((2, 2), 3.0))
    assert torch.equal(module.bias.main_grad, torch.full((2,), 3.0))


# --- megatron.training (Megatron-LM's loop) -----------------------------------------------------

def test_data_loaders_still_draw_their_seed_from_the_global_generator():
    """Why cpu_data_loader_seeds gives each loader a generator: when this fails, Megatron-LM's
    loaders (or torch's) no longer draw from dropout's stream on a host; delete the shim."""
    import inspect

    from megatron.training.datasets import data_samplers

    assert "generator=" not in inspect.getsource(data_samplers.build_pretraining_data_loader)
    loader = torch.utils.data.DataLoader(range(4), batch_size=2)
    before = torch.get_rng_state()
    iter(loader)
    assert not torch.equal(torch.get_rng_state(), before)


def test_the_jit_warmup_still_draws_random_tensors_before_the_model_is_built():
    """Why cpu_jit_warmup_off_the_generator exists: when this fails, pretrain() no longer warms
    up on random tensors (on a host, the generator that initialises the weights); delete it."""
    import inspect

    from megatron.training import initialize, training

    warmup = getattr(initialize._warmup_jit_function, "__wrapped__",
                     initialize._warmup_jit_function)
    assert "torch.rand(" in inspect.getsource(warmup)
    pretrain = inspect.getsource(training.pretrain)
    assert pretrain.index("set_jit_fusion_options(") < pretrain.index("setup_model_and_optimizer(")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU shim")
def test_a_host_run_reports_no_allocator_where_megatron_would_report_zeros(capsys):
    """cpu_memory_report: Megatron-LM's report reads the CUDA allocator, which a host
    does not have (0.00 MB everywhere). When megatron stops reading it there, drop the report."""
    import inspect

    from megatron.training.utils import common_utils

    from helpers.pretrain import pretrain
    from megatron_adacc import megatron_compat

    pretrain("--train-iters", "1", "--log-interval", "1")
    out = capsys.readouterr().out
    megatron = inspect.getsource(common_utils.report_memory.__wrapped__)
    assert "torch.cuda.memory_allocated()" in megatron
    assert "[Rank 0] (after 1 iterations) memory: no GPU, so no allocator statistics\n" in out
    assert "allocated: 0.00" not in out
    assert "cpu_memory_report" in megatron_compat.applied_patches()


def test_a_rerun_checkpoint_is_still_asked_for_without_save():
    """Why rerun_checkpoint_only_with_save exists: when this fails, train() checks --save
    before the rerun state machine's checkpoint; delete the patch."""
    from megatron_adacc import megatron_compat

    assert megatron_compat._rerun_checkpoint_ignores_save()


def test_a_legacy_distributed_optimizer_load_still_rereads_the_tracker():
    """Why legacy_distributed_optimizer_keeps_ckpt_step exists: when this fails, load_checkpoint
    names the distributed optimizer's file without the tracker file; delete the patch."""
    from megatron_adacc import megatron_compat

    assert megatron_compat._legacy_distributed_optimizer_rereads_the_tracker()


def test_a_split_without_validation_still_asks_for_validation():
    """Why no_validation_without_validation_data exists: when this fails, Megatron-LM asks
    whether the validation loader is None before wrapping it in a list; delete the patch."""
    from megatron_adacc import megatron_compat

    assert megatron_compat._validation_wrapped_before_its_none_check()


def test_megatron_lm_still_divides_by_a_missing_eval_interval():
    """Why eval_interval_default exists: when this fails, Megatron-LM sizes its validation data
    without dividing by --eval-interval; delete the patch."""
    from megatron_adacc import megatron_compat

    assert megatron_compat._eval_interval_divided()


def test_a_help_text_of_megatron_lm_still_breaks_help():
    """Why help_with_literal_percent exists: when this fails, every help text of Megatron-LM's
    formats under argparse; delete the patch."""
    from megatron_adacc import megatron_compat

    parser = megatron_compat._parser_with_bad_help()
    assert parser is not None
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()


def test_megatron_lm_still_offers_a_rerun_mode_that_is_no_rerun_mode():
    """Why report_stats_rerun_mode exists: when this fails, --rerun-mode report_stats is a
    RerunMode, or no longer offered; delete the patch."""
    from megatron_adacc import megatron_compat

    assert megatron_compat._report_stats_not_a_rerun_mode()


def test_report_stats_is_megatron_lms_determinism_report():
    from megatron.core.rerun_state_machine import RerunMode

    from megatron_adacc import megatron_compat

    megatron_compat.apply_training()
    assert RerunMode("report_stats") is RerunMode.REPORT_DETERMINISM_STATS
    assert RerunMode("validate_results") is RerunMode.VALIDATE_RESULTS
    with pytest.raises(ValueError, match="'reprot_stats' is not a valid RerunMode"):
        RerunMode("reprot_stats")


def test_megatron_lm_still_reads_its_config_sources_at_every_parser_build():
    """Why field_docstrings_read_once exists: when this fails, Megatron-LM reads its config
    classes' docstrings once, or not from source; delete the patch."""
    from megatron_adacc import megatron_compat

    assert megatron_compat._field_docstrings_read_each_build()


def test_a_parser_built_again_reads_no_source_and_is_the_same(monkeypatch):
    import argparse
    import inspect

    from megatron.training import argument_utils, arguments

    from megatron_adacc import megatron_compat

    def build():
        add = arguments.add_megatron_arguments
        parser = getattr(add, "__wrapped__", add)(argparse.ArgumentParser())
        return [(a.dest, a.help, a.default, a.option_strings) for a in parser._actions]

    megatron_compat.apply_training()
    build()
    reads = []
    getsource = inspect.getsource
    monkeypatch.setattr(argument_utils.inspect, "getsource",
                        lambda *a, **k: reads.append(a) or getsource(*a, **k))
    again = build()
    assert reads == []
    factory = argument_utils.ArgumentGroupFactory
    monkeypatch.setattr(factory, "_get_field_docstrings",
                        factory._get_field_docstrings.__wrapped__)
    assert build() == again and reads  # the same parser, from sources read again


def test_the_target_version_is_the_installed_distributions(monkeypatch):
    import megatron.core

    from megatron_adacc import megatron_compat

    # megatron.core.__version__ inside a git checkout (a virtualenv in a clone of this repo)
    monkeypatch.setattr(megatron.core, "__version__", "0.19.2+6dc3245")
    assert megatron_compat.megatron_core_version() == megatron_compat.TARGET_MEGATRON_CORE



def test_megatron_lms_fused_kernel_defaults_follow_what_is_installed(monkeypatch):
    # Megatron-LM defaults to apex's and Transformer Engine's kernels; on a GPU without them
    # its run asserts (persist_layer_norm), raises (apply_rope_fusion) or fails at the first
    # forward (the compiled masked softmax). Each is turned off only where it is missing.
    from megatron_adacc import megatron_compat
    from helpers.pretrain import parse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_compat, "importable", lambda module: False)
    args = parse("--position-embedding-type", "rope")
    assert (args.gradient_accumulation_fusion, args.no_persist_layer_norm,
            args.masked_softmax_fusion, args.apply_rope_fusion) == (False, True, False, False)
    assert args.bias_gelu_fusion and not args.use_cpu_initialization   # torch.compile's: kept
    monkeypatch.setattr(megatron_compat, "importable", lambda module: True)
    args = parse("--position-embedding-type", "rope")
    assert (args.gradient_accumulation_fusion, args.no_persist_layer_norm,
            args.masked_softmax_fusion, args.apply_rope_fusion) == (True, False, True, True)


def test_gradient_accumulation_fusion_asks_for_the_kernel_its_layers_use(monkeypatch):
    # Local layers fuse with apex's fused_weight_gradient_mlp_cuda, Transformer Engine's with
    # its own: Transformer Engine alone keeps the fusion for its layers only.
    from megatron_adacc import megatron_compat
    from helpers.pretrain import parse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_compat, "importable",
                        lambda module: module == "transformer_engine")
    assert not parse("--transformer-impl", "local").gradient_accumulation_fusion
    args = types.SimpleNamespace(transformer_impl="transformer_engine",
                                 gradient_accumulation_fusion=True)
    assert megatron_compat.kernel_arg_defaults(args) == []
    assert args.gradient_accumulation_fusion
