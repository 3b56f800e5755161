"""Runtime patches that let megatron-core 0.19.2 build and train a GPTModel on a CPU.

Every patch names the megatron-core version it was written against. It is applied only when
CUDA is absent (CPU shims) or when the defect it works around is present. Each one has a test
in tests/training/test_megatron_compat.py that fails once megatron-core no longer needs it. So
a version bump tells us which patches to delete.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import re
import sys
import types
import warnings

import torch

TARGET_MEGATRON_CORE = "0.19.2"

_applied: list[str] = []


def applied_patches() -> list[str]:
    """Names of the patches installed in this process, in order."""
    return list(_applied)


def _cpu_global_memory_buffer() -> None:
    # GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device(); the local
    # DotProductAttention takes its baddbmm input buffer from it.
    from megatron.core import utils

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = functools.reduce(lambda a, b: a * b, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required_len:
            buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buf
        return buf[0:required_len].view(*tensor_shape)

    utils.GlobalMemoryBuffer.get_tensor = get_tensor


def _cpu_rng_tracker() -> None:
    # The tensor-parallel RNG tracker keeps CUDA generator states. On CPU, dropout draws from
    # the CPU default generator, so the tracker must save and restore that one instead.
    # (_set_cuda_rng_state does not fail on CPU: it queues a lazy call that never runs, so
    # without this patch forked dropout silently shares one stream.)
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cpu rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    # fork() warns when the CPU generator moves inside a forked region; on CPU the forked
    # generator *is* the CPU generator, so that warning fires on every dropout call.
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    original_seed = mrandom.model_parallel_cuda_manual_seed

    @functools.wraps(original_seed)
    def model_parallel_manual_seed(seed, *args, **kwargs):
        # Megatron seeds the (absent) CUDA generator for the default stream; seed the CPU
        # generator in its place so the data-parallel stream is reproducible.
        torch.manual_seed(seed)
        return original_seed(seed, *args, **kwargs)

    mrandom.model_parallel_cuda_manual_seed = model_parallel_manual_seed
    import megatron.core.tensor_parallel as tp

    tp.model_parallel_cuda_manual_seed = model_parallel_manual_seed


def _cached_causal_mask() -> None:
    # get_default_causal_mask builds a new s x s mask in every layer's forward, on
    # device="cuda" (which fails without CUDA), and each layer's masked fill saves its own
    # copy for backward: L x s^2 bytes where one mask would do. One mask per length, cached
    # on the device megatron would use: the runtime recognises that tensor as the shared
    # attn_mask by identity, and the ruler and planner count it once. fused_softmax imported
    # the function by name, so the patch must replace that binding too.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    device = "cuda" if torch.cuda.is_available() else "cpu"

    @functools.lru_cache(maxsize=8)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device=device), diagonal=1).bool()

    tutils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _causal_mask_uncached() -> bool:
    from megatron.core.transformer import utils as tutils

    return not hasattr(tutils.get_default_causal_mask, "cache_info")


class _HostStream:
    """The host's one stream: there is no other to wait for, and an event it records is done."""

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> "_HostStream":
        return self  # an event's one call, synchronize, is the stream's

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _HostTorch(types.ModuleType):
    """``torch`` as a megatron-core module sees it after a CPU shim.

    Every name is torch's, except:
    - the tensor factories ignore ``device`` (megatron passes "cuda" or
      torch.cuda.current_device());
    - torch.cuda.current_device() is the host;
    - torch.cuda.synchronize() has nothing to wait for;
    - torch.cuda.current_stream() and every torch.cuda.Stream() are the host's one stream, and
      nothing captures it.
    Only modules whose every use of torch.cuda is one of those get it.
    """

    def __init__(self):
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(current_device=lambda: "cpu",
                                          synchronize=lambda *args, **kwargs: None,
                                          current_stream=lambda *args, **kwargs: _HostStream(),
                                          Stream=lambda *args, **kwargs: _HostStream(),
                                          stream=lambda stream: contextlib.nullcontext(),
                                          is_current_stream_capturing=lambda: False)
        for name in ("tensor", "zeros", "empty"):
            setattr(self, name, self._on_host(getattr(torch, name)))

    @staticmethod
    def _on_host(factory):
        @functools.wraps(factory)
        def make(*args, device=None, **kwargs):
            return factory(*args, **kwargs)
        return make

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_grad_scaler() -> None:
    # megatron's grad scalers keep the loss scale (and the dynamic scaler's bounds and
    # factors) in tensors created with device='cuda', and load_state_dict moves the scale
    # to torch.cuda.current_device().
    from megatron.core.optimizer import grad_scaler

    grad_scaler.torch = _HostTorch()

    def load_state_dict(self, state_dict):
        self._scale = state_dict["scale"].cpu()
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]

    grad_scaler.DynamicGradScaler.load_state_dict = load_state_dict


def _cpu_pipeline_schedules() -> None:
    # Pipeline parallelism: the p2p communicator allocates its receive buffers on
    # torch.cuda.current_device() and calls torch.cuda.synchronize() after batched p2p; the
    # schedules count the loss's tokens in a tensor made on "cuda".
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    p2p_communication.torch = _HostTorch()
    schedules.torch = _HostTorch()


def _cpu_shared_embedding() -> None:
    # With pipeline stages the last stage's copy of the tied word embedding is all-reduced
    # from the first stage's at construction, after ``weight.data = weight.data.cuda()``.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self):
        to_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            original(self)
        finally:
            torch.Tensor.cuda = to_cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _cpu_rotary_embedding() -> None:
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() at the first
    # forward, and YaRN's (--position-embedding-type yarn) its two frequency tables.
    from megatron.core.models.common.embeddings import (rotary_pos_embedding,
                                                        yarn_rotary_pos_embedding)

    rotary_pos_embedding.torch = _HostTorch()
    yarn_rotary_pos_embedding.torch = _HostTorch()


def _cpu_sequence_parallel() -> None:
    # Sequence parallelism: the all-gather and reduce-scatter along the sequence (mappings)
    # and the linear layers' all-gather of their input for backward allocate their output on
    # torch.cuda.current_device(). (layers reads torch.cuda.amp only at import.)
    from megatron.core.tensor_parallel import layers, mappings

    mappings.torch = _HostTorch()
    layers.torch = _HostTorch()


def _cpu_grad_buffers() -> None:
    # DistributedDataParallel's _ParamAndGradBuffer allocates its parameter and gradient
    # buffers on torch.cuda.current_device(); since 0.19 every start_grad_sync makes the
    # current stream wait for CUDA-graph replays' events. (Its torch.cuda.stream and
    # communication stream serve several distributed-optimizer instances only.)
    from megatron.core.distributed import param_and_grad_buffer

    param_and_grad_buffer.torch = _HostTorch()


@contextlib.contextmanager
def _tensor_types_named_cuda():
    """Within it, a host tensor's ``tensor.type()`` names the CUDA type megatron checks for.

    For example "torch.cuda.FloatTensor" for "torch.FloatTensor"."""
    original = torch.Tensor.type

    def type_(tensor, *args, **kwargs):
        name = original(tensor, *args, **kwargs)
        if args or kwargs or tensor.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        with _tensor_types_named_cuda():
            return function(*args, **kwargs)
    return call


def _cpu_moe() -> None:
    # Mixture of experts: the router moves its weight to torch.cuda.current_device() at its
    # first forward and makes its loss tensors there; the all-to-all dispatcher copies its token
    # counts to the host on a side CUDA stream, as the numpy arrays all_to_all_single takes for
    # split sizes, and leaves a host tensor a tensor, which it refuses.
    from megatron.core.transformer.moe import router, token_dispatcher

    router.torch = _HostTorch()
    token_dispatcher.torch = _HostTorch()
    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(to_cpu)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _cpu_attention_variants() -> None:
    # DotProductAttention makes a softmax offset (--softmax-type) on torch.cuda.current_device(),
    # and its softmax the sliding window's mask (--window-size) on "cuda". fused_softmax imported
    # the mask function by name.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import dot_product_attention
    from megatron.core.transformer import utils as tutils

    def get_sliding_window_causal_mask(sq, skv, window_size):
        kept = torch.triu(torch.ones(sq, skv, dtype=torch.bool), diagonal=skv - sq - window_size[0])
        return ~torch.tril(kept, diagonal=skv - sq + window_size[1])

    dot_product_attention.torch = _HostTorch()
    tutils.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def _cpu_optimizer() -> None:
    # megatron's optimizers make their overflow flag and loss scale with device='cuda'
    # (MixedPrecisionOptimizer, FP32Optimizer, get_loss_scale); clip_grads makes its norm
    # and zero-count tensors on 'cuda'; and
    # Float16OptimizerWithFloat16Params, DistributedOptimizer's main-param groups and
    # clip_grad_by_total_norm_fp32 accept only parameters of a torch.cuda.*Tensor type.
    # DistributedOptimizer makes the shards of a --ckpt-format torch load on
    # torch.cuda.current_device().
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    optimizer.torch = _HostTorch()
    clip_grads.torch = _HostTorch()
    distrib_optimizer.torch = _HostTorch()
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip
    fp16 = optimizer.Float16OptimizerWithFloat16Params
    fp16.__init__ = _with_cuda_type_names(fp16.__init__)
    distributed = distrib_optimizer.DistributedOptimizer
    build_groups = distributed.__dict__["_build_model_and_main_param_groups"].__func__
    distributed._build_model_and_main_param_groups = classmethod(
        _with_cuda_type_names(build_groups))


def _cpu_dist_checkpointing() -> None:
    # dist_checkpointing's writer calls torch.cuda.synchronize() before it copies tensors
    # (FileSystemWriterAsync.preload_tensors), and the save's finalisation and the
    # background-save queue make their agreement flags on torch.cuda.current_device().
    from megatron.core.dist_checkpointing.strategies import (async_utils, filesystem_async,
                                                             state_dict_saver)

    filesystem_async.torch = _HostTorch()
    state_dict_saver.torch = _HostTorch()
    async_utils.torch = _HostTorch()


def _distributed_optimizer_with_torch_adam() -> None:
    # With torch's Adam (no apex, no Transformer Engine) DistributedOptimizer assumes state
    # that torch allocates only at the first step, and one step count shared by every
    # parameter: state_dict() asserts a single step, so the sharded state dict a resume
    # loads into cannot be built on a fresh optimizer; load_state_dict() hands every
    # parameter the same step tensor (each step then advances it once per parameter), runs
    # copy_ on parameters that require grad outside no_grad, and the dp_reshardable load
    # copies a step from the parameter state over the restored one.
    from megatron.core.optimizer import distrib_optimizer

    optimizer_class = distrib_optimizer.DistributedOptimizer
    state_dict, load_state_dict = optimizer_class.state_dict, optimizer_class.load_state_dict

    def fresh_state(self) -> None:
        # Exactly what torch's Adam allocates at its first step: zero moments, step 0.
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if not self.optimizer.state[param]:
                    self.optimizer.state[param].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param))

    @functools.wraps(state_dict)
    def state_dict_of_fresh_optimizer(self):
        fresh_state(self)
        return state_dict(self)

    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state):
        with torch.no_grad():
            load_state_dict(self, state)
        for param_state in self.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].detach().clone()

    def set_states_keeping_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        held = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, tensor in held.items():
                # 0.19 passes non-tensor entries too (then leaves the state as it is)
                if key != "step" and isinstance(tensors.get(key), torch.Tensor):
                    tensor.copy_(tensors[key])

    optimizer_class.state_dict = state_dict_of_fresh_optimizer
    optimizer_class.load_state_dict = load_state_dict_with_own_steps
    optimizer_class._set_main_param_and_optimizer_states = set_states_keeping_step


def _torch_adam_in_use() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _checkpoint_without_output_fp8() -> None:
    # CheckpointWithoutOutput.__init__ sets ``self.fp8 = fp8 is not None``, so the False that
    # selective recompute of layernorm/mlp passes becomes True, and without Transformer
    # Engine its forward then fails on FP8GlobalStateManager.
    from megatron.core.tensor_parallel import random as mrandom

    original_init = mrandom.CheckpointWithoutOutput.__init__

    @functools.wraps(original_init)
    def __init__(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = bool(fp8)

    mrandom.CheckpointWithoutOutput.__init__ = __init__


def _transformer_engine_absent() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return not mrandom.HAVE_TE


def _l2_norm_on_the_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's ``local_multi_tensor_l2_norm`` with no value read on the host.

    The norm, shape [1], stays on the tensors' device."""
    tensors = [tensor for tensors in tensor_lists for tensor in tensors]
    if not tensors:
        return torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch.stack([torch.linalg.vector_norm(tensor.float()) for tensor in tensors])
    return torch.linalg.vector_norm(norms).reshape(1), None


def _local_l2_norm_reads_the_host(impl) -> bool:
    """Whether ``impl`` is megatron's fallback norm, which reads each tensor's norm on the host."""
    if getattr(impl, "__name__", None) != "local_multi_tensor_l2_norm":
        return False
    try:  # on meta tensors a read on the host fails
        impl(0, None, [[torch.ones(2, device="meta")]], False)
    except RuntimeError as exc:
        return "meta" in str(exc)
    return False


def _norm_on_the_device(module: str, attribute: str) -> tuple:
    """(patch, probe) of megatron's fallback norm at ``module.attribute``: ours, and whether
    megatron's is there and reads the host."""
    import importlib

    def patch() -> None:
        setattr(importlib.import_module(module), attribute, _l2_norm_on_the_device)

    def probe() -> bool:
        return _local_l2_norm_reads_the_host(getattr(importlib.import_module(module), attribute))

    return patch, probe


CPU_SHIMS = {
    "cpu_global_memory_buffer": _cpu_global_memory_buffer,
    "cpu_rng_tracker": _cpu_rng_tracker,
    "cpu_grad_scaler": _cpu_grad_scaler,
    "cpu_pipeline_schedules": _cpu_pipeline_schedules,
    "cpu_shared_embedding": _cpu_shared_embedding,
    "cpu_rotary_embedding": _cpu_rotary_embedding,
    "cpu_sequence_parallel": _cpu_sequence_parallel,
    "cpu_grad_buffers": _cpu_grad_buffers,
    "cpu_optimizer": _cpu_optimizer,
    "cpu_dist_checkpointing": _cpu_dist_checkpointing,
    "cpu_moe": _cpu_moe,
    "cpu_attention_variants": _cpu_attention_variants,
}


# Defects of megatron-core itself, each with the condition under which it bites.
DEFECT_PATCHES = {
    "checkpoint_without_output_fp8": (_checkpoint_without_output_fp8, _transformer_engine_absent),
    "cached_causal_mask": (_cached_causal_mask, _causal_mask_uncached),
    "distributed_optimizer_with_torch_adam": (_distributed_optimizer_with_torch_adam,
                                              _torch_adam_in_use),
    # Without apex or Transformer Engine, clip_grads' norm is megatron's
    # local_multi_tensor_l2_norm. It builds torch.tensor() from the list of every gradient's
    # norm: on a GPU a copy to the host and a wait for the device per parameter, every step
    # that clips. GPT-345M has 292 parameter tensors; the H200 counted 304 copies to the host
    # a step under every method, Llama-1B 111 for its 99.
    "grad_norm_on_the_device": _norm_on_the_device("megatron.core.optimizer.clip_grads",
                                                   "l2_norm_impl"),
}


def quiet_missing_kernel_notices() -> None:
    """Silence Megatron-LM's import-time notices that Apex or Transformer Engine is missing.

    They are about ten lines on any machine without them; a run names what it lacks in one
    line (kernel_arg_defaults)."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex|"
                                              "transformer-engine).*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime"


def megatron_core_version() -> str:
    """The installed megatron-core distribution's version."""
    from importlib import metadata

    # Not megatron.core.__version__: it appends the short hash of whatever git checkout the
    # interpreter runs in (a virtualenv inside a clone, say).
    return metadata.version("megatron-core")


def apply(force_cpu_shims: bool = False) -> list[str]:
    """Install the patches this process needs, once; returns the names applied."""
    version = megatron_core_version()
    if version != TARGET_MEGATRON_CORE and not _applied:
        warnings.warn(
            f"megatron-adacc's patches target megatron-core {TARGET_MEGATRON_CORE}, "
            f"found {version}; run tests/training/test_megatron_compat.py to see which still apply."
        )
    _install(CPU_SHIMS, DEFECT_PATCHES, force_cpu_shims)
    return applied_patches()


def _install(cpu_shims: dict, defect_patches: dict, force_cpu_shims: bool) -> None:
    """Apply each CPU shim on a host (or when forced), each defect patch where it is needed."""
    # A defect's check runs after the patches before it: some read what those replaced.
    host = force_cpu_shims or not torch.cuda.is_available()
    for name, patch in cpu_shims.items() if host else ():
        if name not in _applied:
            patch()
            _applied.append(name)
    for name, (patch, needed) in defect_patches.items():
        if name not in _applied and needed():
            patch()
            _applied.append(name)


# --- megatron.training (Megatron-LM's loop) on a CPU ------------------------------------------
# megatron.training assumes a GPU throughout: tensors made on "cuda", streams, the CUDA RNG
# state in checkpoints, memory statistics. The modules below see a ``torch`` whose CUDA parts
# are the host's; nothing else about them changes.

def _no_op(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


class _NoStream:
    """A CUDA stream or event on a host: every call does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return _no_op

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _host_cuda(**overrides) -> types.SimpleNamespace:
    """``torch.cuda`` as a host sees it: one "device", the host, with nothing to wait for."""
    calls = dict(
        is_available=lambda: False, device_count=_zero, current_device=lambda: "cpu",
        synchronize=_no_op, empty_cache=_no_op, set_device=_no_op,
        memory_allocated=_zero, max_memory_allocated=_zero, memory_reserved=_zero,
        max_memory_reserved=_zero, reset_peak_memory_stats=_no_op,
        memory_stats=lambda *args, **kwargs: {},
        Stream=_NoStream, Event=_NoStream, current_stream=lambda *args, **kwargs: _NoStream(),
        stream=lambda *args, **kwargs: contextlib.nullcontext(),
        # A checkpoint's "cuda_rng_state": the host has none; dropout draws from the CPU
        # generator, which the checkpoint saves as torch_rng_state.
        get_rng_state=lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8),
        set_rng_state=_no_op,
        nvtx=types.SimpleNamespace(range_push=_no_op, range_pop=_no_op),
        # No GPU architecture (major 0): validate_args then asks tensor parallelism for
        # CUDA_DEVICE_MAX_CONNECTIONS=1 as on a pre-Blackwell GPU, which Megatron-LM's
        # scripts export.
        get_device_properties=lambda *args, **kwargs: types.SimpleNamespace(
            major=0, minor=0, name="cpu", total_memory=0, multi_processor_count=0),
    )
    return types.SimpleNamespace(**{**calls, **overrides})


class _TrainingTorch(_HostTorch):
    """``torch`` for a megatron.training module on a host: _HostTorch with more names on the host.

    Every factory makes host tensors, ``torch.device("cuda...")`` is the host, and the whole of
    ``torch.cuda`` is _host_cuda's."""

    def __init__(self, **cuda_overrides):
        super().__init__()
        self.cuda = _host_cuda(**cuda_overrides)
        for name in ("ones", "full", "arange", "rand", "randn"):
            setattr(self, name, self._on_host(getattr(torch, name)))

    @staticmethod
    def device(*args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


# Modules of Megatron-LM's loop that reach torch.cuda, with what they do with it.
TRAINING_MODULES = (
    "megatron.training.training",            # device tensors, streams, memory reports
    "megatron.training.checkpointing",       # cuda_rng_state, the iteration all-reduce
    "megatron.training.utils.common_utils",  # norms and reductions made on "cuda"
    "megatron.training.models.dist_utils",   # the DDP stream
    "megatron.core.timers",                  # torch.cuda.synchronize at every timer
    "megatron.core.rerun_state_machine",     # saves cuda_rng_state every step
    "megatron.core.distributed.param_and_grad_buffer",  # the grad-reduce streams
)


def _cpu_training_loop() -> None:
    import importlib

    for name in TRAINING_MODULES:
        importlib.import_module(name).torch = _TrainingTorch()
    # initialize_megatron asserts CUDA, and sets up megatron's process groups and seeds the
    # tensor-parallel RNG tracker only when a device is counted: one host "device" here.
    from megatron.training import initialize, training

    initialize.torch = _TrainingTorch(device_count=lambda: 1)
    training.initialize_megatron = functools.partial(initialize.initialize_megatron,
                                                     allow_no_cuda=True)


def _cpu_memory_report() -> None:
    # report_memory prints the CUDA allocator's statistics, which read 0.00 MB here: say that
    # a host has none rather than that the run held nothing.
    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.utils import common_utils

    @functools.wraps(common_utils.report_memory)
    def report_memory(name, process_group=None):
        if parallel_state.get_data_parallel_rank() == 0:
            print(f"[Rank {torch.distributed.get_rank()}] {name} memory: no GPU, so no "
                  f"allocator statistics", flush=True)

    training.report_memory = common_utils.report_memory = report_memory


def _prebuilt_dataset_helpers() -> None:
    # initialize_megatron runs `make` in megatron/core/datasets to build helpers_cpp; the
    # wheel ships the built module without the Makefile, so make fails and the run exits.
    from megatron.core.datasets import utils

    utils.compile_helpers = _no_op


def _dataset_helpers_without_makefile() -> bool:
    import importlib.util
    from pathlib import Path

    from megatron.core.datasets import utils

    return (importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None
            and not (Path(utils.__file__).parent / "Makefile").exists())


# Megatron-LM's defaults that name a kernel outside megatron-core, each with the modules that
# provide it (any one will do; per --transformer-impl where they differ). Where none is
# importable (always on a host), the default is set to megatron-core's plain path:
# Megatron-LM itself would assert or fail at the first forward, although the run needs none.
KERNEL_ARG_DEFAULTS = {
    # megatron-core's own linear layers fuse with apex's kernel; Transformer Engine's its own
    "gradient_accumulation_fusion": (False, {"local": ("fused_weight_gradient_mlp_cuda",),
                                             "transformer_engine": ("transformer_engine",)},
                                     "gradient accumulation"),
    "no_persist_layer_norm": (True, ("apex.contrib.layer_norm.layer_norm",),
                              "persistent layer norm"),
    "masked_softmax_fusion": (False, ("scaled_upper_triang_masked_softmax_cuda",),
                              "masked softmax"),
    "apply_rope_fusion": (False, ("transformer_engine",), "RoPE"),
}
# On a host also torch.compile's fusions (minutes of inductor building C++) and device
# initialisation, which would make parameters on "cuda".
HOST_ARG_DEFAULTS = {
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
    "cross_entropy_loss_fusion": False,
    "use_cpu_initialization": True,
}


def importable(module: str) -> bool:
    """Whether ``module`` can be imported (False too where a parent package is missing)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def kernel_arg_defaults(args) -> list[str]:
    """Turn off Megatron-LM's defaults whose kernels are missing (on a host, all GPU-only ones).

    Returns:
        What each changed default's kernel does, for a GPU run to report.
    """
    host = not torch.cuda.is_available()
    changed = []
    for name, (value, providers, label) in KERNEL_ARG_DEFAULTS.items():
        if isinstance(providers, dict):
            providers = providers.get(getattr(args, "transformer_impl", "local"), ())
        if hasattr(args, name) and (host or not any(map(importable, providers))):
            if getattr(args, name) != value:
                changed.append(label)
            setattr(args, name, value)
    if host:
        for name, value in HOST_ARG_DEFAULTS.items():
            if hasattr(args, name):
                setattr(args, name, value)
    return changed


def eval_interval_default(args) -> None:
    """A missing ``--eval-interval`` means what Megatron-LM documents: no evaluation in training.

    megatron-core 0.19.2 divides by it when it sizes the validation data, so a run without the
    flag ends in a TypeError. The largest interval evaluates only after training, as None should.
    """
    if args.eval_interval is None and _eval_interval_divided():
        args.eval_interval = sys.maxsize


def _eval_interval_divided() -> bool:
    import inspect

    from megatron.training import training

    source = inspect.getsource(training.get_train_valid_test_num_samples)
    return "// args.eval_interval" in source


def _cpu_eager_fusions() -> None:
    # megatron-core wraps its fusions (bias-dropout-add, norms, RoPE, ...) in torch.compile
    # at import, whatever the flags say; on a host inductor then builds C++ for seconds per
    # shape. Eager runs the same math.
    torch._dynamo.config.disable = True


def _rerun_checkpoint_only_with_save() -> None:
    # When the rerun state machine finds a NaN it asks train() for a checkpoint, and train()
    # calls save_checkpoint_and_time whether or not --save was given; without one the save
    # dies on os.path.join(None, ...) and the run ends in a TypeError traceback, not the
    # state machine's exit. Every other caller checks args.save first.
    from megatron.training import training

    original = training.save_checkpoint_and_time

    @functools.wraps(original)
    def save_checkpoint_and_time(*args, **kwargs):
        if training.get_args().save is None:
            return None
        return original(*args, **kwargs)

    training.save_checkpoint_and_time = save_checkpoint_and_time


def _rerun_checkpoint_ignores_save() -> bool:
    import inspect

    from megatron.training import training

    source = inspect.getsource(training.train)
    return "if should_checkpoint:\n            save_checkpoint_and_time(" in source


def _cpu_data_loader_seeds() -> None:
    # A DataLoader without a generator draws its workers' base seed from torch's global
    # generator whenever an iterator over it starts. On a host that generator is dropout's,
    # and a resumed run restores it from the checkpoint before building its loaders: the draw
    # then lands in the restored stream, and the resumed losses differ from the uninterrupted
    # run's. Each loader gets a generator of its own, seeded from --seed.
    from megatron.training import training

    build = getattr(training.build_pretraining_data_loader, "__wrapped__",
                    training.build_pretraining_data_loader)

    @functools.wraps(build)
    def build_pretraining_data_loader(*args, **kwargs):
        loader = build(*args, **kwargs)
        if loader is not None and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(training.get_args().seed)
        return loader

    training.build_pretraining_data_loader = build_pretraining_data_loader


def _cpu_jit_warmup_off_the_generator() -> None:
    # pretrain() warms up the fused bias-GeLU and bias-dropout-add before building the model,
    # on tensors from torch.rand with dropout 0.1. On a GPU those draws come from the CUDA
    # generator; on a host they come from the CPU generator that then initialises the weights,
    # and their number depends on the tensor-parallel size and sequence parallelism. So TP=2
    # and --sequence-parallel trained another model than TP=1. The warm-up compiles nothing
    # here (cpu_eager_fusions), and runs on a copy of the generator's state.
    from megatron.training import initialize

    warmup = getattr(initialize._warmup_jit_function, "__wrapped__",
                     initialize._warmup_jit_function)

    @functools.wraps(warmup)
    def warmup_keeping_the_generator(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warmup(*args, **kwargs)

    initialize._warmup_jit_function = warmup_keeping_the_generator


def _legacy_distributed_optimizer_keeps_ckpt_step() -> None:
    # A --ckpt-format torch checkpoint with the distributed optimizer: load_checkpoint reads the
    # tracker file again to name the optimizer's file, whatever --ckpt-step says. --ckpt-step N
    # (and the fallback from a damaged newest checkpoint, which passes it) then loads N's model
    # with the newest iteration's optimizer state, and counts on from the newest iteration.
    # --load's tracker now names the step asked for; every other reader of it takes that step
    # in its place already.
    from megatron.training import checkpointing

    original = getattr(checkpointing.read_metadata, "__wrapped__", checkpointing.read_metadata)

    @functools.wraps(original)
    def read_metadata(tracker_filename):
        iteration, release = original(tracker_filename)
        flags = checkpointing.get_args()
        if (flags.ckpt_step is not None and flags.load
                and tracker_filename == checkpointing.get_checkpoint_tracker_filename(flags.load)):
            iteration = flags.ckpt_step
        return iteration, release

    checkpointing.read_metadata = read_metadata


def _legacy_distributed_optimizer_rereads_the_tracker() -> bool:
    import inspect

    from megatron.training import checkpointing

    return "iteration, release = read_metadata(tracker_filename)" in inspect.getsource(
        checkpointing.load_checkpoint)


def _no_validation_without_validation_data() -> None:
    # build_train_valid_test_data_loaders wraps the validation dataset in a list before
    # asking whether it is None, so a split with no validation share (--split 100,0,0) still
    # sets do_valid, and the evaluation after training reads a None iterator: a TypeError.
    from megatron.training import training

    original = getattr(training.build_train_valid_test_data_loaders, "__wrapped__",
                       training.build_train_valid_test_data_loaders)

    @functools.wraps(original)
    def build_train_valid_test_data_loaders(*args, **kwargs):
        loaders = original(*args, **kwargs)
        valid = loaders[1]
        empty = isinstance(valid, list) and bool(valid) and all(v is None for v in valid)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # Rank 0's loaders decide, as Megatron-LM's flags do: other tensor-parallel ranks
            # build none, and a rank that skipped validation would leave the others waiting.
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
            decided = torch.tensor([int(empty)], device=device)
            torch.distributed.broadcast(decided, 0)
            empty = bool(decided.item())
        if empty:
            training.get_args().do_valid = False
        return loaders

    training.build_train_valid_test_data_loaders = build_train_valid_test_data_loaders


def _validation_wrapped_before_its_none_check() -> bool:
    import inspect

    from megatron.training import training

    source = inspect.getsource(training.build_train_valid_test_data_loaders)
    return ("valid_ds = [valid_ds]" in source
            and "do_valid = valid_dataloaders is not None and" in source)


class _Gpt2FromFiles:
    """transformers' AutoTokenizer, but GPT-2 is built from its vocab and merges files alone."""

    def __init__(self, auto):
        self._auto = auto

    def from_pretrained(self, pretrained_model_name_or_path, *args, vocab_file=None,
                        merges_file=None, **kwargs):
        if pretrained_model_name_or_path == "gpt2" and vocab_file and merges_file:
            from transformers import GPT2TokenizerFast

            return GPT2TokenizerFast(vocab=vocab_file, merges=merges_file)
        files = {key: value for key, value in (("vocab_file", vocab_file),
                                               ("merges_file", merges_file)) if value}
        return self._auto.from_pretrained(pretrained_model_name_or_path, *args, **files,
                                          **kwargs)

    def __getattr__(self, name):
        return getattr(self._auto, name)


def _gpt2_tokenizer_from_files() -> None:
    # Megatron-LM's GPT2BPETokenizer asks the Hugging Face Hub for "gpt2" even when
    # --vocab-file and --merge-file name both its files: offline, every GPT-2 run fails.
    from megatron.core.tokenizers.text.libraries import huggingface_tokenizer

    huggingface_tokenizer.AutoTokenizer = _Gpt2FromFiles(huggingface_tokenizer.AutoTokenizer)


def _gpt2_tokenizer_reaches_the_hub() -> bool:
    from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer

    config = megatron_hf_tokenizer.MEGATRON_CONFIG_MAP.get("GPT2BPETokenizer", {})
    return config.get("tokenizer_name") == "gpt2"


# A ``%`` that starts no format: argparse's --help would take it for one and raise.
_BARE_PERCENT = re.compile(r"(?<!%)%(?![(%])")


def _parser_with_bad_help() -> argparse.ArgumentParser | None:
    """Megatron-LM's parser when one of its help texts breaks ``--help``; else None."""
    from megatron.training import arguments

    add = getattr(arguments.add_megatron_arguments, "__wrapped__",
                  arguments.add_megatron_arguments)
    parser = add(argparse.ArgumentParser(add_help=False))
    formatter = parser._get_formatter()
    for action in parser._actions:
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            return parser
    return None


def _help_with_literal_percent() -> None:
    # 0.19.2's --moe-paged-stash-buffer-size-factor-cuda help says "1.10 = 10%)": argparse
    # formats every help with %, so `pretrain_gpt.py --help` dies in a ValueError traceback.
    from megatron.training import arguments

    add = arguments.add_megatron_arguments

    @functools.wraps(add)
    def add_megatron_arguments(parser):
        parser = add(parser)
        for action in parser._actions:
            if action.help:
                action.help = _BARE_PERCENT.sub("%%", action.help)
        return parser

    arguments.add_megatron_arguments = add_megatron_arguments


def _field_docstrings_read_once() -> None:
    # Megatron-LM builds its parser up to three times a run (a --config's keys, parse_args, the
    # fault-tolerance setup). Each build reads and parses the source of some 40 config
    # dataclasses for their field docstrings: about 0.2 s a build on two cores. A class's
    # docstrings do not change in a process.
    from megatron.training.argument_utils import ArgumentGroupFactory

    read, cache = ArgumentGroupFactory._get_field_docstrings, {}

    @functools.wraps(read)
    def field_docstrings(self, src_cfg_class):
        if src_cfg_class not in cache:
            cache[src_cfg_class] = read(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    ArgumentGroupFactory._get_field_docstrings = field_docstrings


def _field_docstrings_read_each_build() -> bool:
    import inspect

    from megatron.training.argument_utils import ArgumentGroupFactory

    read = ArgumentGroupFactory._get_field_docstrings
    return "inspect.getsource(" in inspect.getsource(getattr(read, "__wrapped__", read))


def _report_stats_rerun_mode() -> None:
    # --rerun-mode offers report_stats, and initialize_megatron looks it up as a RerunMode, whose
    # value for it is report_determinism_stats: the documented choice dies in a ValueError.
    from megatron.core.rerun_state_machine import RerunMode

    RerunMode._missing_ = classmethod(
        lambda cls, value: cls.REPORT_DETERMINISM_STATS if value == "report_stats" else None)


def _report_stats_not_a_rerun_mode() -> bool:
    import typing

    from megatron.core.rerun_state_machine import RerunMode
    from megatron.training.config.resilience_config import RerunStateMachineConfig

    offered = typing.get_args(RerunStateMachineConfig.__annotations__["rerun_mode"])
    return "report_stats" in offered and "report_stats" not in {mode.value for mode in RerunMode}


TRAINING_CPU_SHIMS = {"cpu_training_loop": _cpu_training_loop,
                      "cpu_memory_report": _cpu_memory_report,
                      "cpu_eager_fusions": _cpu_eager_fusions,
                      "cpu_data_loader_seeds": _cpu_data_loader_seeds,
                      "cpu_jit_warmup_off_the_generator": _cpu_jit_warmup_off_the_generator}
TRAINING_DEFECT_PATCHES = {
    "prebuilt_dataset_helpers": (_prebuilt_dataset_helpers, _dataset_helpers_without_makefile),
    # --log-params-norm: Megatron-LM's calc_params_l2_norm takes the same fallback norm as
    # clip_grads (grad_norm_on_the_device), one host read per parameter.
    "params_norm_on_the_device": _norm_on_the_device("megatron.training.utils.common_utils",
                                                     "multi_tensor_l2norm"),
    "rerun_checkpoint_only_with_save": (_rerun_checkpoint_only_with_save,
                                        _rerun_checkpoint_ignores_save),
    "gpt2_tokenizer_from_files": (_gpt2_tokenizer_from_files, _gpt2_tokenizer_reaches_the_hub),
    "no_validation_without_validation_data": (_no_validation_without_validation_data,
                                              _validation_wrapped_before_its_none_check),
    "legacy_distributed_optimizer_keeps_ckpt_step": (
        _legacy_distributed_optimizer_keeps_ckpt_step,
        _legacy_distributed_optimizer_rereads_the_tracker),
    "report_stats_rerun_mode": (_report_stats_rerun_mode, _report_stats_not_a_rerun_mode),
    # Before help_with_literal_percent, whose check builds a parser.
    "field_docstrings_read_once": (_field_docstrings_read_once,
                                   _field_docstrings_read_each_build),
    "help_with_literal_percent": (_help_with_literal_percent,
                                  lambda: _parser_with_bad_help() is not None),
}


def apply_training(force_cpu_shims: bool = False) -> list[str]:
    """apply(), and the patches Megatron-LM's loop needs here; applied once."""
    apply(force_cpu_shims)
    _install(TRAINING_CPU_SHIMS, TRAINING_DEFECT_PATCHES, force_cpu_shims)
    return applied_patches()
