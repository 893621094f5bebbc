"""``ls_adam``: fairseq's ``adam`` (decoupled weight decay, bias correction) in one fused step.

Options and state are fairseq adam's (``--adam-betas``, ``--adam-eps``, ``--weight-decay``,
``--fp16-adam-stats``; per-parameter state ``step``, ``exp_avg``, ``exp_avg_sq``), so optimizer
checkpoints move between ``adam`` and ``ls_adam`` both ways. All parameters of a group are
updated by one call of :func:`ls_fairseq.ops.adam_step` (one kernel launch on the GPU) with fp32
math whatever the storage dtype: fp32 master under ``--fp16``, fp16/bf16 weights and grads under
``--memory-efficient-fp16``.
"""
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf

from .. import ops


@dataclass
class LSAdamConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    use_old_adam: bool = field(default=False, metadata={"help": "ignored; accepted for adam parity"})
    fp16_adam_stats: bool = field(
        default=False, metadata={"help": "keep Adam moments in fp16 (math stays fp32)"}
    )
    amsgrad: bool = field(default=False, metadata={"help": "not supported by ls_adam"})
    lr: List[float] = II("optimization.lr")


@register_optimizer("ls_adam", dataclass=LSAdamConfig)
class FairseqLSAdam(FairseqOptimizer):
    def __init__(self, cfg: LSAdamConfig, params):
        super().__init__(cfg)
        if getattr(cfg, "amsgrad", False):
            raise ValueError("--optimizer ls_adam does not support --amsgrad; use --optimizer adam")
        self._optimizer = LSAdam(params, fp16_stats=cfg.fp16_adam_stats, **self.optimizer_config)

    @property
    def optimizer_config(self):
        betas = self.cfg.adam_betas
        betas = eval(betas) if isinstance(betas, str) else OmegaConf.to_container(betas) \
            if OmegaConf.is_config(betas) else betas
        return {
            "lr": self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr,
            "betas": tuple(betas),
            "eps": self.cfg.adam_eps,
            "weight_decay": self.cfg.weight_decay,
        }


class LSAdam(torch.optim.Optimizer):
    """Adam with fairseq's semantics; every group is one fused multi-tensor step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, fp16_stats=False):
        if amsgrad:
            raise ValueError("ls_adam does not support amsgrad")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False)
        super().__init__(params, defaults)
        self.fp16_stats = fp16_stats

    @property
    def supports_memory_efficient_fp16(self):
        return True

    @property
    def supports_flat_params(self):
        return True

    @property
    def supports_step_with_scale(self):
        return True

    def _state_for(self, p):
        state = self.state[p]
        stats_dtype = torch.float16 if self.fp16_stats else torch.float32
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=stats_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=stats_dtype)
            if self.fp16_stats:
                state["exp_avg_scale"] = state["exp_avg_sq_scale"] = 1.0
        else:  # e.g. loaded from a checkpoint written by fairseq's adam on another device/dtype
            for key in ("exp_avg", "exp_avg_sq"):
                if state[key].device != p.device or state[key].dtype != stats_dtype:
                    state[key] = state[key].to(device=p.device, dtype=stats_dtype)
            if self.fp16_stats:
                state.setdefault("exp_avg_scale", 1.0)
                state.setdefault("exp_avg_sq_scale", 1.0)
        return state

    def _step_fp16_stats(self, p, state, group, step, grad_scale):
        """fairseq's ``--fp16-adam-stats``: moments stored in fp16 divided by a per-tensor scale
        (max-norm / fp16 max), as fairseq's FusedAdam does, so small second moments survive."""
        fp16_max = torch.finfo(torch.float16).max
        exp_avg = state["exp_avg"].float() * state["exp_avg_scale"]
        exp_avg_sq = state["exp_avg_sq"].float() * state["exp_avg_sq_scale"]
        beta1, beta2 = group["betas"]
        ops.adam_step(
            [p.data], [p.grad.data], [exp_avg], [exp_avg_sq], lr=group["lr"], beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step,
            grad_scale=grad_scale,
        )
        state["exp_avg_scale"] = 1e-8 + exp_avg.abs().max() / fp16_max
        state["exp_avg_sq_scale"] = 1e-8 + exp_avg_sq.abs().max() / fp16_max
        state["exp_avg"] = (exp_avg / state["exp_avg_scale"]).half()
        state["exp_avg_sq"] = (exp_avg_sq / state["exp_avg_sq_scale"]).half()

    @torch.no_grad()
    def step(self, closure=None, scale=1.0, groups=None):
        """``scale``: the gradients are multiplied by 1/scale (fairseq's step-with-scale hook)."""
        loss = closure() if closure is not None else None
        for group in self.param_groups if groups is None else groups:
            by_step = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ls_adam does not support sparse gradients")
                state = self._state_for(p)
                state["step"] += 1
                if self.fp16_stats:
                    self._step_fp16_stats(p, state, group, state["step"], 1.0 / scale)
                    continue
                # tensors resumed from different checkpoints may be at different steps
                by_step.setdefault(state["step"], []).append((p, state))
            beta1, beta2 = group["betas"]
            for step, items in by_step.items():
                ops.adam_step(
                    [p.data for p, _ in items],
                    [p.grad.data for p, _ in items],
                    [s["exp_avg"] for _, s in items],
                    [s["exp_avg_sq"] for _, s in items],
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], step=step, grad_scale=1.0 / scale,
                )
        return loss
