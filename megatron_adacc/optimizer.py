"""AdamW with megatron's weight-decay grouping, fp32 main weights for bf16 models, and
gradient-norm clipping that counts tensor-parallel shards once.

On CPU this is the optimizer (megatron's own allocates on CUDA). With bf16 parameters the
update runs on fp32 copies ("main params", as megatron does) so small updates are not lost
to bf16 rounding.
"""
from __future__ import annotations

import torch

from megatron_adacc.model import collective_device


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    # megatron: biases and normalisation weights are not decayed
    return param.ndim == 1 or name.endswith(".bias")


class MainParamAdamW:
    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float,
                 betas: tuple[float, float]):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        self.needs_main = any(p.dtype != torch.float32 for p in self.model_params)
        self.main_params = [
            p.detach().float().clone().requires_grad_(True) if self.needs_main else p
            for p in self.model_params
        ]
        decay = [m for (n, p), m in zip(named, self.main_params) if not _no_decay(n, p)]
        no_decay = [m for (n, p), m in zip(named, self.main_params) if _no_decay(n, p)]
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay, betas=betas
        )

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.needs_main:
            for m in self.main_params:
                m.grad = None

    def _copy_grads_to_main(self) -> None:
        if self.needs_main:
            for p, m in zip(self.model_params, self.main_params):
                m.grad = None if p.grad is None else p.grad.float()

    def clip_and_step(self, clip_grad: float) -> float:
        """Clip by the global gradient norm (0 disables clipping), step, and return the norm.
        (megatron's clip_grads allocates its overflow buffer on CUDA, hence our own.)"""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        self._copy_grads_to_main()
        grads = [m.grad for m in self.main_params if m.grad is not None]
        # A parameter replicated across tensor-parallel ranks is counted on one rank only.
        tp_group = parallel_state.get_tensor_model_parallel_group()
        squares = torch.zeros(1, dtype=torch.float64, device=collective_device(tp_group))
        for p, m in zip(self.model_params, self.main_params):
            if m.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                squares += m.grad.double().pow(2).sum()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(squares, group=tp_group)
        norm = float(squares.sqrt())
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
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.needs_main:
            with torch.no_grad():
                for m, saved in zip(self.main_params, state["main_params"]):
                    m.copy_(saved)
