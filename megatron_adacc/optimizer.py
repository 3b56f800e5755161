"""AdamW with megatron's weight-decay grouping, fp32 main weights and gradients for 16-bit
models, loss scaling, gradient-norm clipping that counts tensor-parallel shards once, and
megatron's distributed optimizer (--use-distributed-optimizer, ZeRO-1).

On CPU this is the optimizer (megatron's own allocates on CUDA). With bf16 or fp16
parameters it works as megatron's mixed-precision optimizer does: the update runs on fp32
copies ("main params") so small updates are not lost to 16-bit rounding, and each
micro-batch's gradients are added into fp32 main gradients as backward produces them (the
16-bit gradient is freed at once), so accumulation and the data-parallel reduction of the
main gradients run in fp32. With a grad scaler (megatron's, fp16) the loss is scaled before
backward; a step whose gradients overflow is skipped and the scale backs off.

Sharded over a data-parallel group, it works as megatron's DistributedOptimizer lays its
buffers out: the trainable parameters, in order, form one flat range of N elements; rank r
of D owns the contiguous elements ``shard_range(N, D, r)`` and keeps the AdamW moments (and,
for a 16-bit model, the fp32 main params) of those elements only. Every rank still holds the
full, data-parallel-reduced gradient (gloo has no reduce-scatter), so the norm, the
overflow check and clipping are computed exactly as unsharded; each rank then steps its
range and the ranges are all-gathered into every rank's model parameters. The update of an
element is the same arithmetic as unsharded, so sharded and unsharded runs agree bit for
bit. ``static_bytes`` states what a rank holds, from the same ``owned_pieces``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_adacc.errors import InputError
from megatron_adacc.model import collective_device

# torch AdamW keeps a 0-dim fp32 step count per parameter it steps.
_STEP_COUNT_BYTES = 4
# The AdamW moments (exp_avg, exp_avg_sq) and a main param are fp32.
_FP32_BYTES = 4


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    # megatron: biases and normalisation weights are not decayed
    return param.ndim == 1 or name.endswith(".bias")


def _model_parallel_group():
    """The tensor x pipeline group, whose ranks hold the model's different parameters;
    None when this rank holds them all."""
    from megatron.core import parallel_state

    group = parallel_state.get_model_parallel_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


def shard_range(numel: int, shards: int, shard: int) -> tuple[int, int]:
    """[start, end) of the elements of a flat range of ``numel`` that rank ``shard`` of
    ``shards`` owns: contiguous ranges of ceil(numel / shards) elements in rank order, so
    rank 0's is the largest (megatron pads its buffer to a multiple of D instead; nothing
    is held here for the padding)."""
    size = -(-numel // shards)
    return min(shard * size, numel), min((shard + 1) * size, numel)


def owned_pieces(numels: list[int], shards: int, shard: int) -> list[tuple[int, int, int]]:
    """(parameter index, start, end) of the elements of each parameter that rank ``shard``
    of ``shards`` owns, the parameters laid end to end in order; parameters it owns
    nothing of are left out."""
    first, last = shard_range(sum(numels), shards, shard)
    pieces, offset = [], 0
    for index, numel in enumerate(numels):
        start, end = max(first, offset), min(last, offset + numel)
        if start < end:
            pieces.append((index, start - offset, end - offset))
        offset += numel
    return pieces


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer steps, in the order of its flat range."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def static_bytes(model: torch.nn.Module, shards: int = 1, shard: int | None = None) -> int:
    """What parameters, gradients and MainParamAdamW hold for the whole run on rank
    ``shard`` of the ``shards`` data-parallel ranks its state is sharded over (1: not
    sharded), or with ``shard`` None the most any of them holds (what one budget for every
    rank must count): parameters and buffers, an fp32 gradient per trainable parameter (a
    16-bit model's gradients live in fp32 main gradients, its 16-bit ones only briefly in
    backward), and for the elements the rank owns AdamW's two fp32 moments, fp32 main
    params when the model is not fp32, and a step count per parameter piece (so a later
    rank, owning fewer elements in more pieces, can hold a few bytes more than rank 0).
    Transients (the all-gather of a sharded step) are not counted."""
    if shard is None:
        return max(static_bytes(model, shards, rank) for rank in range(shards))
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    trainable = [p for _, p in trainable_parameters(model)]
    pieces = owned_pieces([p.numel() for p in trainable], shards, shard)
    owned = sum(end - start for _, start, end in pieces)
    main = owned if any(p.dtype != torch.float32 for p in trainable) else 0
    return (held + _FP32_BYTES * sum(p.numel() for p in trainable)
            + _FP32_BYTES * (2 * owned + main) + _STEP_COUNT_BYTES * len(pieces))


class MainParamAdamW:
    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float,
                 betas: tuple[float, float], grad_scaler=None, shard_group=None):
        """``shard_group``: the data-parallel group to shard the state over
        (--use-distributed-optimizer), None to hold it whole."""
        named = trainable_parameters(model)
        self.model_params = [p for _, p in named]
        self.needs_main = any(p.dtype != torch.float32 for p in self.model_params)
        self.grad_scaler = grad_scaler  # megatron's MegatronGradScaler, or None
        self.shard_group = shard_group
        self.shards = dist.get_world_size(shard_group) if shard_group is not None else 1
        self.shard = dist.get_rank(shard_group) if shard_group is not None else 0
        self.pieces = owned_pieces([p.numel() for p in self.model_params], self.shards,
                                   self.shard)
        self.main_grads: torch.Tensor | None = None  # one flat fp32 buffer (16-bit models)
        self._main_grad_views: list[torch.Tensor] = []
        if self.needs_main:
            self._attach_main_grads()
        self.main_params = [self._main_piece(*piece) for piece in self.pieces]
        groups = [{"params": [], "wd_mult": 1.0}, {"params": [], "wd_mult": 0.0}]
        for (index, _, _), main in zip(self.pieces, self.main_params):
            groups[1 if _no_decay(*named[index]) else 0]["params"].append(main)
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay, betas=betas
        )

    def _main_piece(self, index: int, start: int, end: int) -> torch.Tensor:
        """What the inner AdamW steps for these elements: the parameter itself (fp32, whole),
        a view of it (fp32, part), or an fp32 copy whose gradient is a view of the main
        gradients (16-bit). Whole pieces keep the parameter's shape."""
        param = self.model_params[index]
        whole = end - start == param.numel()
        if not self.needs_main:
            return param if whole else param.detach().view(-1)[start:end]
        main = param.detach().view(-1)[start:end].float().clone()
        grad = self._main_grad_views[index].view(-1)[start:end]
        if whole:
            main, grad = main.view_as(param), grad.view_as(param)
        main.requires_grad_(True)
        main.grad = grad
        return main

    def _attach_main_grads(self) -> None:
        # One contiguous buffer (megatron's grad buffer): the data-parallel all-reduce is one
        # collective, and every main param's .grad is a view into it.
        self.main_grads = torch.zeros(sum(p.numel() for p in self.model_params),
                                      dtype=torch.float32, device=self.model_params[0].device)
        offset = 0
        for p in self.model_params:
            view = self.main_grads[offset:offset + p.numel()].view_as(p)
            self._main_grad_views.append(view)
            # megatron's name for it: finalize_model_grads all-reduces the tied word
            # embedding's main_grad between the first and last pipeline stages.
            p.main_grad = view
            offset += p.numel()
            p.register_post_accumulate_grad_hook(self._accumulate_hook(view))

    @staticmethod
    def _accumulate_hook(main_grad: torch.Tensor):
        def accumulate(param: torch.Tensor) -> None:
            main_grad.add_(param.grad)
            param.grad = None
        return accumulate

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """What the loss is multiplied by before backward (a 1-element tensor), or None."""
        return self.grad_scaler.scale if self.grad_scaler is not None else None

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.main_grads is not None:
            self.main_grads.zero_()

    def _full_grads(self) -> list[torch.Tensor | None]:
        """Each model parameter's whole fp32 gradient (None where it has none): every rank
        holds the data-parallel-reduced gradient, sharded or not."""
        return self._main_grad_views if self.needs_main else [p.grad for p in self.model_params]

    def _unscale_and_find_inf(self, grads: list[torch.Tensor]) -> bool:
        """Divide the gradients by the loss scale; True when any is not finite on any
        model-parallel rank (tensor-parallel shards and pipeline stages hold different
        parameters)."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, self.grad_scaler.inv_scale.to(grads[0].device))
        group = _model_parallel_group()
        if group is not None:
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX,
                                         group=group)
        return bool(found_inf.item())

    def clip_and_step(self, clip_grad: float, before_step=None) -> float | None:
        """Unscale, clip by the global gradient norm (0 disables clipping), step, and return
        the norm; None when the gradients overflowed and the step was skipped (the
        parameters and the optimizer's state are then untouched and the scale backs off).
        ``before_step(norm)`` runs once the norm is known and before anything changes, so a
        check that raises (a non-finite norm) leaves the weights as they were.
        (megatron's clip_grads allocates its overflow buffer on CUDA, hence our own.)"""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        full = self._full_grads()
        grads = [g for g in full if g is not None]
        if self.grad_scaler is not None and grads:
            found_inf = self._unscale_and_find_inf(grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return None
        # megatron's norm: a parameter replicated across tensor-parallel ranks, and the last
        # pipeline stage's copy of the tied word embedding, are counted once.
        group = _model_parallel_group()
        squares = torch.zeros(1, dtype=torch.float64, device=collective_device(
            parallel_state.get_model_parallel_group()))
        for p, g in zip(self.model_params, full):
            if (g is not None and param_is_not_tensor_parallel_duplicate(p)
                    and param_is_not_shared(p)):
                squares += g.double().pow(2).sum()
        if group is not None:
            torch.distributed.all_reduce(squares, group=group)
        norm = float(squares.sqrt())
        if before_step is not None:
            before_step(norm)
        if clip_grad > 0 and grads and norm > clip_grad:
            torch._foreach_mul_(grads, clip_grad / (norm + 1e-6))
        if not self.needs_main:  # a part of an fp32 parameter steps with that part's gradient
            for (index, start, end), main in zip(self.pieces, self.main_params):
                if main is not self.model_params[index]:
                    grad = full[index]
                    main.grad = None if grad is None else grad.view(-1)[start:end]
        self.optimizer.step()
        self._publish()
        return norm

    @torch.no_grad()
    def _publish(self) -> None:
        """The stepped elements into the model parameters of every rank."""
        if self.shards == 1:
            if self.needs_main:
                for p, m in zip(self.model_params, self.main_params):
                    p.copy_(m)
            return
        dtype = self.model_params[0].dtype
        size = -(-sum(p.numel() for p in self.model_params) // self.shards)
        local = torch.zeros(size, dtype=dtype, device=self.model_params[0].device)
        offset = 0
        for main in self.main_params:
            local[offset:offset + main.numel()].copy_(main.view(-1))
            offset += main.numel()
        gathered = local.new_empty(size * self.shards)
        dist.all_gather(list(gathered.split(size)), local, group=self.shard_group)
        offset = 0
        for p in self.model_params:
            p.view(-1).copy_(gathered[offset:offset + p.numel()])
            offset += p.numel()

    def state_dict(self) -> dict:
        """This rank's state: sharded, only its own range (the checkpoint is per rank)."""
        state = {"optimizer": self.optimizer.state_dict(), "shard": [self.shard, self.shards]}
        if self.needs_main:
            state["main_params"] = [m.detach().clone() for m in self.main_params]
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("shard", [0, 1])  # checkpoints before sharding held it whole
        if list(saved) != [self.shard, self.shards]:
            raise InputError(_shard_mismatch(saved, [self.shard, self.shards]))
        self.optimizer.load_state_dict(state["optimizer"])
        if self.needs_main:
            with torch.no_grad():
                for m, saved_main in zip(self.main_params, state["main_params"]):
                    m.copy_(saved_main)
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])


def _shard_mismatch(saved: list[int], here: list[int]) -> str:
    def describe(shard: list[int]) -> str:
        return ("whole" if shard[1] == 1
                else f"shard {shard[0]} of {shard[1]} (--use-distributed-optimizer)")

    return (f"the checkpoint's optimizer state is {describe(saved)}, this run's is "
            f"{describe(here)}: resume with the --use-distributed-optimizer setting and "
            f"data-parallel size it was saved with (resharding is not supported)")
