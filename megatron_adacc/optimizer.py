"""AdamW with megatron's weight-decay grouping, fp32 main weights and gradients for 16-bit
models, loss scaling, and gradient-norm clipping that counts tensor-parallel shards once.

On CPU this is the optimizer (megatron's own allocates on CUDA). With bf16 or fp16
parameters it works as megatron's mixed-precision optimizer does: the update runs on fp32
copies ("main params") so small updates are not lost to 16-bit rounding, and each
micro-batch's gradients are added into fp32 main gradients as backward produces them (the
16-bit gradient is freed at once), so accumulation and the data-parallel reduction of the
main gradients run in fp32. With a grad scaler (megatron's, fp16) the loss is scaled before
backward; a step whose gradients overflow is skipped and the scale backs off.
"""
from __future__ import annotations

import torch

from megatron_adacc.model import collective_device


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    # megatron: biases and normalisation weights are not decayed
    return param.ndim == 1 or name.endswith(".bias")


def _model_parallel_group():
    """The tensor x pipeline group, whose ranks hold the model's different parameters;
    None when this rank holds them all."""
    from megatron.core import parallel_state

    group = parallel_state.get_model_parallel_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


class MainParamAdamW:
    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float,
                 betas: tuple[float, float], grad_scaler=None):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        self.needs_main = any(p.dtype != torch.float32 for p in self.model_params)
        self.grad_scaler = grad_scaler  # megatron's MegatronGradScaler, or None
        self.main_grads: torch.Tensor | None = None  # one flat fp32 buffer (16-bit models)
        if self.needs_main:
            self.main_params = [p.detach().float().clone().requires_grad_(True)
                                for p in self.model_params]
            self._attach_main_grads()
        else:
            self.main_params = self.model_params
        decay = [m for (n, p), m in zip(named, self.main_params) if not _no_decay(n, p)]
        no_decay = [m for (n, p), m in zip(named, self.main_params) if _no_decay(n, p)]
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay, betas=betas
        )

    def _attach_main_grads(self) -> None:
        # One contiguous buffer (megatron's grad buffer): the data-parallel all-reduce is one
        # collective, and every main param's .grad is a view into it.
        self.main_grads = torch.zeros(sum(p.numel() for p in self.model_params),
                                      dtype=torch.float32, device=self.model_params[0].device)
        offset = 0
        for p, m in zip(self.model_params, self.main_params):
            m.grad = self.main_grads[offset:offset + p.numel()].view_as(p)
            # megatron's name for it: finalize_model_grads all-reduces the tied word
            # embedding's main_grad between the first and last pipeline stages.
            p.main_grad = m.grad
            offset += p.numel()
            p.register_post_accumulate_grad_hook(self._accumulate_hook(m))

    @staticmethod
    def _accumulate_hook(main: torch.Tensor):
        def accumulate(param: torch.Tensor) -> None:
            main.grad.add_(param.grad)
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

        grads = [m.grad for m in self.main_params if m.grad is not None]
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
        for p, m in zip(self.model_params, self.main_params):
            if (m.grad is not None and param_is_not_tensor_parallel_duplicate(p)
                    and param_is_not_shared(p)):
                squares += m.grad.double().pow(2).sum()
        if group is not None:
            torch.distributed.all_reduce(squares, group=group)
        norm = float(squares.sqrt())
        if before_step is not None:
            before_step(norm)
        if clip_grad > 0 and grads and norm > clip_grad:
            torch._foreach_mul_(grads, clip_grad / (norm + 1e-6))
        self.optimizer.step()
        if self.needs_main:
            with torch.no_grad():
                for p, m in zip(self.model_params, self.main_params):
                    p.copy_(m)
        return norm

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.needs_main:
            state["main_params"] = [m.detach().clone() for m in self.main_params]
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.needs_main:
            with torch.no_grad():
                for m, saved in zip(self.main_params, state["main_params"]):
                    m.copy_(saved)
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
