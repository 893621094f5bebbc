"""``ls_adam``: fairseq's ``adam`` (decoupled weight decay, bias correction) in one fused step.

Options and state are fairseq adam's (``--adam-betas``, ``--adam-eps``, ``--weight-decay``,
``--fp16-adam-stats``; per-parameter state ``step``, ``exp_avg``, ``exp_avg_sq``), so optimizer
checkpoints move between ``adam`` and ``ls_adam`` both ways. All parameters of a group are
updated by one call of :func:`ls_fairseq.ops.adam_step` (one kernel launch on the GPU) with fp32
math whatever the storage dtype: fp32 master under ``--fp16``, fp16/bf16 weights and grads under
``--memory-efficient-fp16``.
"""
import logging
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf

from .. import ops, switches
from ..distributed import exchange_of, flat_all_reduce, peer_all_reduce, sharded_step
from . import deferred_overflow

logger = logging.getLogger(__name__)

_FP16_MAX = torch.finfo(torch.float16).max
FUSED_COPY = "--ls-fused-fp16-copy"
DEFERRED = "--ls-deferred-overflow-check"
#: why the sharded step cannot apply without fairseq's flat fp32 master (checked before training
#: from the config, and again at the first update from the optimizer fairseq built)
NO_FLAT_MASTER = "it needs fairseq's flat fp32 master (drop --fp16-no-flatten-grads)"
NO_FLAT_MASTER_BF16 = ("it needs fairseq's flat fp32 master, which --bf16 training does not build "
                       "(one fp32 tensor per parameter): train with --fp16")


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
    ls_fused_fp16_copy: bool = field(
        default=False,
        metadata={"help": "require the fused fp16 copy (on by default with --fp16/--bf16 where it "
                  "applies): ls_adam reads the fp16/bf16 grads and writes the fp16/bf16 weights "
                  "inside its Adam kernel, instead of fairseq's FP16Optimizer copy loops; with "
                  "this flag a run where it cannot apply is refused"},
    )
    ls_no_fused_fp16_copy: bool = field(
        default=False, metadata={"help": "turn the fused fp16 copy off (fairseq's FP16Optimizer "
                                 "copies the grads and weights)"},
    )
    ls_deferred_overflow_check: bool = field(
        default=False,
        metadata={"help": "require the deferred overflow check (on by default with the fused fp16 "
                  "copy where it applies): the update's grad norm is tested on the GPU (an "
                  "overflowing update is skipped there) and booked in the loss scaler at the next "
                  "update, so no update waits for the GPU; with this flag a run where it cannot "
                  "apply is refused (ls_fairseq/optim/deferred_overflow.py)"},
    )
    ls_no_deferred_overflow_check: bool = field(
        default=False, metadata={"help": "turn the deferred overflow check off (every update "
                                 "reads its grad norm back, as fairseq does)"},
    )
    ls_sharded_optimizer_step: bool = field(
        default=False,
        metadata={"help": "require the sharded optimizer step (on by default where it applies: "
                  "several GPUs of one host with the copy-engine all-reduce, the fused fp16 copy "
                  "and a flat fp32 master): each GPU runs Adam on the gradient shards it sums "
                  "and sends the updated fp16 weights to the others; with this flag a run where "
                  "it cannot apply is refused (ls_fairseq/distributed/sharded_step.py)"},
    )
    ls_no_sharded_optimizer_step: bool = field(
        default=False, metadata={"help": "turn the sharded optimizer step off (every GPU gets "
                                 "the summed gradients and runs Adam on the whole model)"},
    )
    lr: List[float] = II("optimization.lr")


@register_optimizer("ls_adam", dataclass=LSAdamConfig)
class FairseqLSAdam(FairseqOptimizer):
    def __init__(self, cfg: LSAdamConfig, params):
        super().__init__(cfg)
        if getattr(cfg, "amsgrad", False):
            raise switches.Refused("--optimizer ls_adam does not support --amsgrad; use "
                                   "--optimizer adam")
        switches.resolve(getattr(cfg, "ls_fused_fp16_copy", False),
                         getattr(cfg, "ls_no_fused_fp16_copy", False), FUSED_COPY)
        deferred = switches.resolve(getattr(cfg, "ls_deferred_overflow_check", False),
                                    getattr(cfg, "ls_no_deferred_overflow_check", False), DEFERRED)
        if deferred == switches.ON and getattr(cfg, "ls_no_fused_fp16_copy", False):
            raise switches.Refused(f"{DEFERRED} needs the fused fp16 copy: drop "
                                   f"--ls-no-fused-fp16-copy")
        # read by LSFusedFP16Optimizer, which runs the sharded step
        self.sharded_step_mode = sharded = switches.resolve(
            getattr(cfg, "ls_sharded_optimizer_step", False),
            getattr(cfg, "ls_no_sharded_optimizer_step", False), sharded_step.FLAG)
        if sharded == switches.ON and getattr(cfg, "ls_no_fused_fp16_copy", False):
            raise switches.Refused(f"{sharded_step.FLAG} needs the fused fp16 copy: drop "
                                   f"--ls-no-fused-fp16-copy")
        if sharded == switches.ON and cfg.fp16_adam_stats:
            raise switches.Refused(f"{sharded_step.FLAG} does not support --fp16-adam-stats (its "
                                   f"moment scales are per tensor, not per shard)")
        self._optimizer = LSAdam(params, fp16_stats=cfg.fp16_adam_stats, **self.optimizer_config)
        self._logged_flat_all_reduce = False

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

    def all_reduce_grads(self, module, exchange=None):
        """Under ``--ddp-backend legacy_ddp``/``no_c10d`` with flat gradients (``--ls-cuda-graphs``
        replays): one in-place all-reduce per buffer instead of fairseq's copy loops
        (:mod:`ls_fairseq.distributed.flat_all_reduce`), or none where the engine already issued
        it during the backward (the update's ``GradientExchange`` says ``reduced``; also under
        torch DDP, where the engine always does).

        ``exchange``: this update's ``distributed.GradientExchange``, as ``LSFusedFP16Optimizer``
        passes it; fairseq's wrappers call this method with the trainer's model only, and the
        exchange is then taken from the engine that keeps the model's gradients
        (``distributed.exchange_of(module)``; None: no engine)."""
        if exchange is None:
            exchange = exchange_of(module)
        if flat_all_reduce.all_reduce_flat(module, exchange):
            if not self._logged_flat_all_reduce:
                self._logged_flat_all_reduce = True
                logger.info("ls_adam: gradients are flat; all-reducing them in place "
                            "(one call per buffer, no staging copy)")
        else:
            super().all_reduce_grads(module)


class LSAdam(torch.optim.Optimizer):
    """Adam with fairseq's semantics; every group is one fused multi-tensor step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, fp16_stats=False):
        if amsgrad:
            raise ValueError("ls_adam does not support amsgrad")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False)
        super().__init__(params, defaults)
        self.fp16_stats = fp16_stats
        self._consolidate = None  # makes the state whole on every rank (register_consolidate)

    def register_consolidate(self, consolidate):
        """``consolidate()`` makes the sharded state whole on every rank (collective): called by
        ``consolidate_state_dict``. LSFusedFP16Optimizer registers it once the sharded optimizer
        step is taken."""
        self._consolidate = consolidate

    def consolidate_state_dict(self):
        """Called by fairseq's trainer on every rank before a checkpoint is saved
        (``Trainer.consolidate_optimizer``): under the sharded optimizer step the ranks sum
        their shards of the fp32 master and moments, so ``state_dict`` is the whole state."""
        if self._consolidate is not None:
            self._consolidate()

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
                # A "<key>_scale" entry means the tensor holds true / scale (fp16 stats, maybe
                # cast to the param's dtype by torch's load_state_dict: exact, cast back).
                t, scale_key = state[key], key + "_scale"
                if t.device == p.device and t.dtype == stats_dtype and (
                        self.fp16_stats == (scale_key in state)):
                    continue
                t = t.to(p.device)
                if scale_key in state and not self.fp16_stats:  # scaled -> true fp32 values
                    t = t.float() * state.pop(scale_key)
                elif scale_key not in state and self.fp16_stats:
                    # true moments -> scaled fp16 (a plain cast would flush small v to zero)
                    t = t.float()
                    state[scale_key] = 1e-8 + t.abs().max() / _FP16_MAX
                    t = t / state[scale_key]
                state[key] = t.to(dtype=stats_dtype)
            if self.fp16_stats:
                state.setdefault("exp_avg_scale", 1.0)
                state.setdefault("exp_avg_sq_scale", 1.0)
        return state

    @staticmethod
    def _kernels_ok(tensors):
        return ops._extension.use_kernels(*tensors) and ops._extension.has_op("multi_tensor_adam")

    @staticmethod
    def _scales_tensor(states, device):
        """[n, 2] float32 (exp_avg_scale, exp_avg_sq_scale) of each state, on the device."""
        vals = [v for s in states for v in (s["exp_avg_scale"], s["exp_avg_sq_scale"])]
        if not any(torch.is_tensor(v) for v in vals):
            return torch.tensor(vals, dtype=torch.float32).view(-1, 2).to(device)
        return torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                            for v in vals]).view(-1, 2)

    def _step_fp16_stats_fused(self, items, group, step, grad_scale):
        """All tensors of one step count: the kernel's two-pass scaled-fp16-moment update."""
        from ..ops.adam import adam_step_cuda

        params = [p.data for p, _ in items]
        states = [s for _, s in items]
        scales = self._scales_tensor(states, params[0].device)
        beta1, beta2 = group["betas"]
        adam_step_cuda(
            params, [p.grad.data for p, _ in items], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"], step=step,
            grad_scale=grad_scale, moment_scales=scales)
        for i, s in enumerate(states):
            s["exp_avg_scale"], s["exp_avg_sq_scale"] = scales[i, 0], scales[i, 1]

    def _step_fp16_stats(self, p, state, group, step, grad_scale):
        """fairseq's ``--fp16-adam-stats``: moments stored in fp16 divided by a per-tensor scale
        (max-norm / fp16 max), as fairseq's FusedAdam does, so small second moments survive."""
        fp16_max = _FP16_MAX
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

    # ---- fused fp16 model copy (--ls-fused-fp16-copy, used by LSFusedFP16Optimizer) ----------

    def _master_views(self, fp16_params, flat, state):
        """Per-tensor views of the flat fp32 master and its moments (cached: views cost ~µs)."""
        key = (flat.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
               tuple(p.data_ptr() for p in fp16_params))
        cached = getattr(self, "_views_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        masters, ms, vs, offset = [], [], [], 0
        for p in fp16_params:
            n = p.numel()
            masters.append(flat.data[offset:offset + n])
            ms.append(state["exp_avg"][offset:offset + n])
            vs.append(state["exp_avg_sq"][offset:offset + n])
            offset += n
        if offset != flat.numel():
            raise RuntimeError(f"ls_adam: the flat fp32 master has {flat.numel()} elements but the "
                               f"fp16 params have {offset}")
        views = (masters, ms, vs, [p.data.view(-1) for p in fp16_params])
        self._views_cache = (key, views)
        return views

    @torch.no_grad()
    def step_fp16_master(self, fp16_params, fp32_params, grad_scale=1.0, shard=None):
        """One Adam step that reads the fp16 model grads (``p.grad``, times ``grad_scale``),
        updates the fp32 master (fairseq's flat tensor, or one fp32 tensor per param) and its
        moments, and writes the new fp16/bf16 weights into the model, in one kernel launch (two
        with --fp16-adam-stats). State layout is exactly that of ``step`` on the fp32 master, so
        checkpoints are those of fairseq's FP16Optimizer + adam. ``shard``
        (``distributed.sharded_step.ShardedStep``, flat master only): only this rank's shards are
        stepped. Returns the states whose step count it advanced. Without the CUDA kernels: the
        same math in PyTorch (no --fp16-adam-stats with a flat master there)."""
        if len(self.param_groups) != 1:
            raise RuntimeError("ls_adam --ls-fused-fp16-copy supports one param group")
        if shard is not None and (self.fp16_stats or not torch.is_tensor(fp32_params)):
            raise RuntimeError("ls_adam: the sharded step needs a flat fp32 master and no "
                               "--fp16-adam-stats")
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"])
        fp16_params = [p for p in fp16_params if p.requires_grad]
        if shard is None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in fp16_params]
        if self._kernels_ok([p.data for p in fp16_params]):
            from ..ops.adam import adam_step_cuda as adam_step
        elif self.fp16_stats and torch.is_tensor(fp32_params):
            raise RuntimeError("ls_adam --ls-fused-fp16-copy --fp16-adam-stats with a flat fp32 "
                               "master needs the CUDA kernels")
        else:
            from ..ops.adam import adam_step_skip_nonfinite_reference as adam_step
        if torch.is_tensor(fp32_params):  # flat master: one state, one step count, one scale
            state = self._state_for(fp32_params)
            state["step"] += 1
            if shard is not None:
                masters, grads, ms, vs, copies = shard.adam_views(
                    fp16_params, fp32_params, state["exp_avg"], state["exp_avg_sq"])
            else:
                masters, ms, vs, copies = self._master_views(fp16_params, fp32_params, state)
            scales = None
            if self.fp16_stats:
                scales = self._scales_tensor([state], fp32_params.device).expand(
                    len(masters), 2).contiguous()
                hyper["shared_moment_scale"] = True
            adam_step(masters, grads, ms, vs, step=state["step"], grad_scale=grad_scale,
                      model_copies=copies, moment_scales=scales, **hyper)
            if self.fp16_stats:
                state["exp_avg_scale"], state["exp_avg_sq_scale"] = scales[0, 0], scales[0, 1]
            return [state]
        by_step, stepped = {}, []
        for p16, g, p32 in zip(fp16_params, grads, fp32_params):
            state = self._state_for(p32)
            state["step"] += 1
            stepped.append(state)
            by_step.setdefault(state["step"], []).append((p16, g, p32, state))
        for step, items in by_step.items():
            states = [it[3] for it in items]
            scales = self._scales_tensor(states, items[0][2].device) if self.fp16_stats else None
            adam_step([it[2].data.view(-1) for it in items], [it[1] for it in items],
                      [s["exp_avg"].view(-1) for s in states],
                      [s["exp_avg_sq"].view(-1) for s in states], step=step,
                      grad_scale=grad_scale, model_copies=[it[0].data.view(-1) for it in items],
                      moment_scales=scales, **hyper)
            if self.fp16_stats:
                for i, s in enumerate(states):
                    s["exp_avg_scale"], s["exp_avg_sq_scale"] = scales[i, 0], scales[i, 1]
        return stepped

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
                # tensors resumed from different checkpoints may be at different steps
                by_step.setdefault(state["step"], []).append((p, state))
            beta1, beta2 = group["betas"]
            for step, items in by_step.items():
                if self.fp16_stats:
                    if self._kernels_ok([p.data for p, _ in items]):
                        self._step_fp16_stats_fused(items, group, step, 1.0 / scale)
                    else:
                        for p, state in items:
                            self._step_fp16_stats(p, state, group, step, 1.0 / scale)
                    continue
                ops.adam_step(
                    [p.data for p, _ in items],
                    [p.grad.data for p, _ in items],
                    [s["exp_avg"] for _, s in items],
                    [s["exp_avg_sq"] for _, s in items],
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], step=step, grad_scale=1.0 / scale,
                )
        return loss


# ---- the fused fp16 copy (FP16Optimizer built by ls_fairseq.fairseq_patches) --------------

from fairseq.optim.fp16_optimizer import FP16Optimizer  # noqa: E402


def _fp32_grad_norm(grads):
    """L2 norm of fp16/bf16/fp32 grads accumulated in fp32 (what fairseq computes on its fp32
    copy of the grads), with few launches."""
    if len(grads) == 0:
        return torch.tensor(0.0, device="cuda" if torch.cuda.is_available() else "cpu")
    try:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    except (RuntimeError, TypeError, AttributeError):
        norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


class LSFP16Optimizer(FP16Optimizer):
    """fairseq's ``FP16Optimizer`` for ``ls_adam`` without the fused copy under ``--bf16``.

    ``ls_adam`` takes fairseq's step-with-scale route (the gradients' multiply factor is passed
    to the step instead of multiplied into them first). fairseq's wrapper resets that factor in
    ``zero_grad`` only when it has a loss scaler, which ``--bf16`` has not: the factor would
    shrink by 1 / sample_size every update until it is 0, and the run would stop training and
    then fail with a ZeroDivisionError. Here it is reset to 1 every update, as fairseq's own
    unscaling does after multiplying it in. Everything else is fairseq's."""

    def zero_grad(self):
        super().zero_grad()
        if self.scaler is None:
            self._multiply_factor = 1.0


class LSFusedFP16Optimizer(FP16Optimizer):
    """fairseq's ``FP16Optimizer`` (``--fp16``/``--bf16``) without its per-tensor copy loops.

    fairseq copies every fp16 grad into a flat fp32 buffer before the step (and to compute the
    grad norm), and every updated fp32 master slice back into the fp16 weights after it. Here the
    grad norm is computed from the fp16 grads (fp32 accumulation), and ``ls_adam``'s kernel reads
    the fp16 grads, updates the fp32 master and moments and writes the fp16 weights in one
    launch. The fp32 grad buffer is never used and is freed (4 bytes per parameter).

    Same loss scaling, overflow handling (the scaler raises OverflowError from
    ``clip_grad_norm`` before any state is touched), ``--clip-norm``, ``--update-freq`` and
    state_dict as fairseq's FP16Optimizer + adam.

    With ``--ls-deferred-overflow-check`` (``--fp16`` only) nothing is read back in the update:
    the overflow test and the clip factor stay on the device and the scaler's bookkeeping is
    done at the next ``backward`` (:mod:`.deferred_overflow`).

    On several GPUs with the copy-engine all-reduce each GPU steps only the gradient shards it
    sums and sends the new fp16 weights to the others (``--ls-sharded-optimizer-step``,
    :mod:`ls_fairseq.distributed.sharded_step`): decided in ``all_reduce_grads`` at the first
    update, the grad norm from the shards in ``clip_grad_norm``, the whole state summed from the
    shards in ``LSAdam.consolidate_state_dict`` before fairseq saves a checkpoint.
    """

    def __init__(self, cfg, params, fp32_optimizer, fp32_params, **kwargs):
        super().__init__(cfg, params, fp32_optimizer, fp32_params, **kwargs)
        if not isinstance(fp32_optimizer.optimizer, LSAdam):
            raise ValueError(f"{FUSED_COPY} needs --optimizer ls_adam")
        if isinstance(fp32_params, dict):
            if len(fp32_params) != 1:
                raise ValueError("--ls-fused-fp16-copy: pipeline-parallel fp32 params (several "
                                 "devices) are not supported")
            self._master = next(iter(fp32_params.values()))
            self._master.grad = None
        else:
            self._master = list(fp32_params)
            for p32 in self._master:
                p32.grad = None
        self._deferred = defers_overflow_check(cfg)
        self._pending = None  # deferred_overflow.PendingOverflowCheck of the last step
        self._skipped_updates = 0  # booked overflows the trainer has not taken back yet
        # the sharded step (distributed/sharded_step.py): None until decided at the first update
        # all-reduced during the backward, then a ShardedStep or False
        self._sharding = None
        self._shard = None  # the ShardedStep when this update's gradients came scattered

    @property
    def defers_host_reads(self) -> bool:
        """True when an update leaves its GPU work queued without reading anything back (read by
        ``fairseq_patches``: fairseq-train's wps is then timed after a wait for the GPU)."""
        return self._deferred

    # read-only views of the optimizer's state (for tests and tools)
    @property
    def master(self):
        """fairseq's fp32 master: one flat tensor, or one tensor per parameter (``--bf16``,
        ``--fp16-no-flatten-grads``)."""
        return self._master

    @property
    def sharding(self):
        """The sharded optimizer step of this run (``distributed.sharded_step.ShardedStep``),
        False where it does not apply, None until decided (at the first update all-reduced
        during the backward)."""
        return self._sharding

    @property
    def pending_overflow_check(self):
        """``--ls-deferred-overflow-check``: the last step's ``PendingOverflowCheck``, booked at
        the next backward (None: nothing pending)."""
        return self._pending

    def all_reduce_grads(self, module):
        """fairseq's all-reduce call (after the engine reduced the gradients during the
        backward), and where the sharded optimizer step is decided and found: the update's
        ``GradientExchange`` is taken from the engine here, once, and passed on."""
        exchange = exchange_of(module)
        # FP16Optimizer.all_reduce_grads, with the exchange
        self.fp32_optimizer.all_reduce_grads(module, exchange)
        self._shard = None
        if exchange is None:
            return
        if self._sharding is None and exchange.reduced:
            self._sharding = self._start_sharding(exchange)
        if exchange.scattered:
            self._shard = self._sharding
        elif self._sharding and self._sharding.stale:
            # a whole all-reduce after sharded steps (a step outside the engine's buckets):
            # the whole Adam step needs the whole master and moments
            self._consolidate()

    def _start_sharding(self, exchange):
        """The ShardedStep of this run, or False; collective where the engine's all-reduce
        runs by copy engines (every rank decides alike: same flags, same engine decision)."""
        mode, flag = self.fp32_optimizer.sharded_step_mode, sharded_step.FLAG
        if mode == switches.OFF:
            return False
        reason = self._sharding_conflict(exchange.grads)
        if not reason:
            shard, reason = sharded_step.create(exchange.grads, exchange.peer)
            if shard is not None:
                exchange.peer.scatter_only_from_next_update()
                self.fp32_optimizer.optimizer.register_consolidate(self._consolidate)
                logger.info(f"{flag[2:]}: each of the {shard.peer.plan.world} GPUs runs Adam "
                            f"on the gradient shards it sums and sends the new fp16 weights to "
                            f"the others; {flag.replace('--ls-', '--ls-no-')} for a whole step "
                            f"on every GPU")
                return shard
        if reason:
            switches.refuse_or_step_aside(mode, flag, reason, logger)
        return False

    def _sharding_conflict(self, grads):
        """Why this optimizer cannot take the sharded step (empty: it can), from what is the
        same on every rank."""
        if not torch.is_tensor(self._master):
            # --bf16 (no scaler): fairseq builds one fp32 tensor per parameter
            return NO_FLAT_MASTER_BF16 if self.scaler is None else NO_FLAT_MASTER
        if self.fp32_optimizer.optimizer.fp16_stats:
            return "it does not support --fp16-adam-stats"
        ids = {id(p) for p in grads.params}
        if len(ids) != len(grads.params) or ids != {id(p) for p in self.fp16_params
                                                    if p.requires_grad}:
            return "the optimizer's parameters are not the model's (criterion parameters?)"
        return ""

    def _consolidate(self):
        """The whole fp32 master and moments on every rank (collective; LSAdam calls it before
        a checkpoint)."""
        if not self._sharding or not self._sharding.stale:
            return
        handling = sys.exc_info()[1]
        if handling is not None and not isinstance(handling, FloatingPointError):
            # fairseq's crash.pt after an error of this rank alone: the others would never
            # join the sums; state_dict then refuses, after the error itself is reported
            return
        opt = self.fp32_optimizer.optimizer
        state = opt.state.get(self._master, {})
        tensors = [self._master.data] + [state[k] for k in ("exp_avg", "exp_avg_sq")
                                         if k in state]
        self._sharding.consolidate([p for p in self.fp16_params if p.requires_grad], tensors)

    def _sync_fp16_grads_to_fp32(self):
        self._needs_sync = False  # the kernel reads the fp16 grads directly

    def _sync_fp32_params_to_fp16(self):
        pass  # the kernel writes the fp16 weights

    def backward(self, loss):
        self._book_pending()  # before the loss is scaled: fairseq's scale for this update
        super().backward(loss)

    def _book_pending(self):
        """--ls-deferred-overflow-check: fairseq's scaler bookkeeping of the last step, now."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        old_scale = self.scaler.loss_scale if self.scaler is not None else None
        # bf16 (no scaler): raises on a non-finite norm, as fairseq
        self._skipped_updates += pending.book(self.scaler)
        if self.scaler is not None and self.scaler.loss_scale != old_scale:
            self._multiply_factor *= old_scale / self.scaler.loss_scale  # zero_grad set 1 / old

    def take_skipped_updates(self) -> int:
        """How many updates the trainer counted that turned out to be skipped (fp16 overflows
        found one update late by the deferred check), since the last call. fairseq's trainer
        (``fairseq_patches``, patch 8) takes them back from its update count before the next
        optimizer step, so the count and the learning rate stay fairseq's."""
        skipped, self._skipped_updates = self._skipped_updates, 0
        return skipped

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """fairseq's clip/overflow check with one host synchronisation instead of five.

        The norm is read back once and returned as a CPU tensor: fairseq's trainer tests it with
        ``torch.isfinite`` twice more, the second time after the optimizer step, and on a CUDA
        tensor each test waits for the GPU, the second one for the whole Adam kernel, while
        nothing else is queued behind it. Same values: the fp32 norm, the clip factor and the
        overflow check are computed on the host from it."""
        if self._deferred:
            self._book_pending()  # normally done by backward
        total = self._shard.grad_norm() if self._shard else _fp32_grad_norm(
            [p.grad for p in self.fp16_params if p.grad is not None])
        if aggregate_norm_fn is not None:
            total = aggregate_norm_fn(total)
        if self._deferred:  # no read-back: overflow and clipping folded into the step's factor
            norm, self._multiply_factor = deferred_overflow.guarded_factor(
                total, self._multiply_factor, max_norm)
            self._pending = deferred_overflow.PendingOverflowCheck(norm)
            return deferred_overflow.GradNormForTrainer.wrap(norm)
        if torch.is_tensor(self._multiply_factor):  # the kernel takes it on the grads' device
            self._multiply_factor = self._multiply_factor.to(total.device)
        grad_norm = (self._multiply_factor * total).float().cpu()
        value = float(grad_norm)
        if self.scaler is not None:
            if value > max_norm > 0.0:
                self._multiply_factor *= max_norm / value
            self.scaler.check_overflow(value)
        elif max_norm > 0.0:
            self._multiply_factor *= min(max_norm / (value + 1e-6), 1.0)
        return grad_norm

    def step(self, closure=None, groups=None):
        loss = closure() if closure is not None else None
        if self._deferred and self._pending is None:  # no clip_grad_norm call before the step
            self.clip_grad_norm(0.0)
        shard, self._shard = self._shard, None
        stepped = self.fp32_optimizer.optimizer.step_fp16_master(
            self.fp16_params, self._master, grad_scale=self._multiply_factor, shard=shard)
        if shard is not None:
            shard.push_params()
        if self._deferred:
            self._pending.states = stepped  # booked at the next backward
        elif self.scaler is not None:
            self.scaler.update()
        return loss

    def state_dict(self):
        if self._deferred:
            self._book_pending()  # the saved loss scale and step counts are fairseq's
        if self._sharding and self._sharding.stale:
            raise RuntimeError(f"{sharded_step.FLAG}: the optimizer state is sharded over the "
                               f"GPUs; call optimizer.optimizer.consolidate_state_dict() on every "
                               f"rank first (fairseq's trainer does, before saving a checkpoint), "
                               f"or train with --ls-no-sharded-optimizer-step")
        return super().state_dict()

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        self._pending = None  # the loaded state replaces what it would have booked
        self._skipped_updates = 0
        super().load_state_dict(state_dict, optimizer_overrides)
        if self._sharding:
            self._sharding.stale = False  # the loaded moments are whole on every rank

    def zero_grad(self):
        for p in self.fp16_params:
            p.grad = None
        self._needs_sync = False
        if self.scaler is not None:
            self._multiply_factor = 1.0 / float(self.scaler.loss_scale)
        else:
            self._multiply_factor = 1.0


def defers_overflow_check(cfg, quiet: bool = False) -> bool:
    """Whether LSFusedFP16Optimizer defers its overflow test (``--ls-deferred-overflow-check``,
    on by default where it applies). Under ``--bf16`` there is no loss scaler: the deferred test
    then only stops the run on a non-finite grad norm (one update late), as fairseq's trainer
    does at once. ``quiet``: the answer only (``fairseq_patches``, patch 1, once the optimizer
    has said it or refused)."""
    opt = getattr(cfg, "optimizer", None)
    mode = switches.resolve(getattr(opt, "ls_deferred_overflow_check", False),
                            getattr(opt, "ls_no_deferred_overflow_check", False), DEFERRED)
    if mode == switches.OFF:
        return False
    reason = _deferred_check_conflict(cfg)
    if reason is not None:
        if not quiet:
            switches.refuse_or_step_aside(mode, DEFERRED, reason, logger)
        return False
    return True


def _deferred_check_conflict(cfg):
    """Why the deferred check cannot run inside the fused copy (None: it can)."""
    if getattr(getattr(cfg, "optimizer", None), "fp16_adam_stats", False):
        return "it does not support --fp16-adam-stats"
    return deferred_overflow.grad_norm_check_conflict(cfg)


def _fp16_optimizer_conflict(cfg):
    """Why fairseq's trainer builds no ``FP16Optimizer`` for ``cfg``, the wrapper whose copies
    the fused copy replaces (its ``_build_optimizer``: fp32 training, ``--amp``, the
    memory-efficient wrappers, FSDP under ``--fp16``); None where it builds one."""
    common = getattr(cfg, "common", None)
    fp16, bf16 = getattr(common, "fp16", False), getattr(common, "bf16", False)
    if not (fp16 or bf16 or getattr(common, "amp", False)):
        return ("this run trains in fp32: there are no fp16/bf16 weight copies to fuse "
                "(--fp16 or --bf16 train with them)")
    backend = getattr(getattr(cfg, "distributed_training", None), "ddp_backend", None)
    if backend == "fully_sharded" and fp16:
        return ("--ddp-backend fully_sharded trains through fairseq's "
                "MemoryEfficientFP16Optimizer, which keeps no fp32 master weights to copy")
    for name in ("memory_efficient_fp16", "memory_efficient_bf16"):
        if getattr(common, name, False):
            return (f"--{name.replace('_', '-')} keeps no fp32 master weights (fairseq's "
                    f"MemoryEfficientFP16Optimizer): there is no copy to fuse")
    if getattr(common, "amp", False):
        return "--amp trains through fairseq's AMPOptimizer, which keeps no fp16 weight copies"
    return None


def _fused_copy_step_aside(cfg, cuda: bool):
    """Why the fused copy steps aside in a run that builds fairseq's FP16Optimizer (None: it
    applies)."""
    if getattr(getattr(cfg, "distributed_training", None), "pipeline_model_parallel", False):
        return "pipeline model parallelism keeps fp32 params on several devices"
    if getattr(getattr(cfg, "optimizer", None), "fp16_adam_stats", False) and not cuda:
        return "--fp16-adam-stats with a flat fp32 master needs the CUDA kernels"
    return None


def _trains_on_cuda(cfg) -> bool:
    return torch.cuda.is_available() and not getattr(getattr(cfg, "common", None), "cpu", False)


def fp16_optimizer_class(cfg):
    """The FP16Optimizer class fairseq's trainer should build for ``cfg`` (``--fp16``/``--bf16``):
    for ``--optimizer ls_adam``, :class:`LSFusedFP16Optimizer` where the fused copy applies (it is
    on by default), else :class:`LSFP16Optimizer` under ``--bf16``; None (fairseq's own)
    otherwise. Called by ``ls_fairseq.fairseq_patches``."""
    opt = getattr(cfg, "optimizer", None)
    if opt is None or getattr(opt, "_name", None) != "ls_adam":
        return None
    unfused = LSFP16Optimizer if getattr(getattr(cfg, "common", None), "bf16", False) else None
    mode = switches.resolve(getattr(opt, "ls_fused_fp16_copy", False),
                            getattr(opt, "ls_no_fused_fp16_copy", False), FUSED_COPY)
    if mode == switches.OFF:
        return unfused
    reason = _fused_copy_step_aside(cfg, _trains_on_cuda(cfg))
    if reason is not None:
        switches.refuse_or_step_aside(mode, FUSED_COPY, reason, logger)
        return unfused
    return LSFusedFP16Optimizer


def _sharded_step_conflict(cfg, run: switches.RunFacts, fused_copy):
    """Why the sharded step cannot apply to ``run`` (None: it may; the rest is decided with
    every rank at the first update). ``fused_copy``: why the fused copy cannot, or None."""
    engine = peer_all_reduce.run_conflict(run)
    if engine:
        return f"it runs on the copy-engine all-reduce, which cannot apply: {engine}"
    if fused_copy is not None:
        return f"it runs inside ls_adam's fused fp16 copy, which cannot apply: {fused_copy}"
    common = getattr(cfg, "common", None)
    if getattr(common, "bf16", False):
        return NO_FLAT_MASTER_BF16
    if getattr(common, "fp16_no_flatten_grads", False):
        return NO_FLAT_MASTER
    criterion = getattr(cfg, "criterion", None)
    if not hasattr(criterion, "ls_no_copy_engine_all_reduce"):
        return ("it runs on the copy-engine all-reduce of --criterion "
                "ls_label_smoothed_cross_entropy")
    for off in ("ls_no_copy_engine_all_reduce", "ls_no_cuda_graphs"):
        if getattr(criterion, off, False):
            return (f"it runs on the copy-engine all-reduce, which --{off.replace('_', '-')} "
                    f"turns off")
    return None


def check_run(cfg, run: switches.RunFacts) -> None:
    """Before training (``fairseq_patches``, patch 9): refuses each mechanism of ls_adam that the
    user asked for (``--ls-X``) and that cannot apply to ``run``. Switches left to their
    defaults are not looked at here: each mechanism steps aside, with its one line, where it is
    decided."""
    opt = getattr(cfg, "optimizer", None)
    if getattr(opt, "_name", None) != "ls_adam":
        return
    fused = _fp16_optimizer_conflict(cfg) or _fused_copy_step_aside(cfg, run.cuda)
    if getattr(opt, "ls_fused_fp16_copy", False) and fused:
        raise switches.refusal(FUSED_COPY, fused)
    if getattr(opt, "ls_deferred_overflow_check", False):
        reason = (f"it runs inside ls_adam's fused fp16 copy, which cannot apply: {fused}"
                  if fused else _deferred_check_conflict(cfg))
        if reason:
            raise switches.refusal(DEFERRED, reason)
    if getattr(opt, "ls_sharded_optimizer_step", False):
        reason = _sharded_step_conflict(cfg, run, fused)
        if reason:
            raise switches.refusal(sharded_step.FLAG, reason)
