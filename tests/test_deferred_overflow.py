"""``--ls-deferred-overflow-check`` vs fairseq's FP16Optimizer + adam (CPU, per-tensor fp32
masters: ``--fp16-no-flatten-grads``; the flat master and the CUDA kernel are covered in
tests/gpu/test_adam_cuda.py).

Both optimizers get the same gradient sequence, with overflows injected, consecutive ones
included, and a short scale window so the scale also grows. fairseq raises OverflowError from
``clip_grad_norm`` and its trainer skips the step; the deferred optimizer never raises, skips the
step itself and books the overflow at the next backward. The results must be fairseq's: same
weights (relative 1e-6 on the fp32 masters: the clip factor is computed in fp32 on the device
instead of in Python's float64), same fp16 weights (one fp16 ulp), same loss scale, same Adam
step counts, the same norms for the updates that did not overflow, one log line per overflow.
"""
import copy
import io
import logging
import pickle

import pytest
import torch
from fairseq.logging import metrics
from fairseq.optim.fp16_optimizer import FP16Optimizer

from fairseq_helpers import fp16_optimizer_cfg, fp16_trainer_run
from ls_fairseq.fairseq_patches import take_back_skipped_updates
from ls_fairseq.optim.deferred_overflow import GradNormForTrainer, guarded_factor
from ls_fairseq.optim.ls_adam import LSFP16Optimizer, LSFusedFP16Optimizer

SHAPES = [(7,), (33, 5), (1025,), (2, 3, 11)]
DEFERRED = ["--ls-fused-fp16-copy", "--ls-deferred-overflow-check"]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).half()) for s in SHAPES]


def _build(optimizer, extra):
    params = _params()
    cfg = fp16_optimizer_cfg(optimizer, ["--fp16-no-flatten-grads", *extra])
    return params, FP16Optimizer.build_optimizer(cfg, params)


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("update_freq", [1, 2])
@pytest.mark.parametrize("overflow_at", [(4,), (3, 4, 9), (11,)])
def test_matches_fairseq_fp16_optimizer_with_overflows(clip, update_freq, overflow_at, caplog):
    extra = ["--clip-norm", str(clip), "--fp16-scale-window", "3"]
    ref_params, ref = _build("adam", extra)
    params, opt = _build("ls_adam", extra + DEFERRED)
    assert isinstance(opt, LSFusedFP16Optimizer) and opt.defers_host_reads
    steps = 12
    ref_overflows, ref_norms = fp16_trainer_run(ref, ref_params, steps, 1, overflow_at,
                                                update_freq, clip)
    with caplog.at_level(logging.INFO, logger="ls_fairseq.optim.deferred_overflow"):
        overflows, norms = fp16_trainer_run(opt, params, steps, 1, overflow_at, update_freq,
                                            clip)
        state = opt.state_dict()  # books the last update (it may have overflowed)
    assert ref_overflows == len(overflow_at) and overflows == 0
    notes = [r for r in caplog.records if "gradient overflow detected" in r.getMessage()]
    assert len(notes) == len(overflow_at)
    assert state["loss_scale"] == ref.state_dict()["loss_scale"]
    assert [s["step"] for s in state["state"].values()] == [steps - len(overflow_at)] * len(SHAPES)
    finite = [float(n) for n in norms if torch.isfinite(n.plain())]
    assert len(finite) == len(ref_norms)
    torch.testing.assert_close(torch.tensor(finite), torch.tensor([float(n) for n in ref_norms]),
                               rtol=1e-6, atol=0)
    for p, rp in zip(params, ref_params):
        torch.testing.assert_close(p.float(), rp.float(), rtol=2**-10, atol=0)
    for m, rm in zip(opt.fp32_params, ref.fp32_params):
        torch.testing.assert_close(m, rm, rtol=1e-6, atol=1e-7)


def test_min_loss_scale_error_one_update_late():
    """fairseq stops training when an overflow would take the scale below --min-loss-scale; the
    deferred optimizer raises the same error at the next update's backward."""
    extra = ["--fp16-init-scale", "1", "--min-loss-scale", "0.5"]
    ref_params, ref = _build("adam", extra)
    with pytest.raises(FloatingPointError, match="Minimum loss scale reached"):
        fp16_trainer_run(ref, ref_params, 4, 1, overflow_at=(2,))
    params, opt = _build("ls_adam", extra + DEFERRED)
    fp16_trainer_run(opt, params, 3, 1, overflow_at=(2,))  # updates 0-2 run
    with pytest.raises(FloatingPointError, match="Minimum loss scale reached"):
        fp16_trainer_run(opt, params, 1, 2)  # the backward of update 3 books update 2


def test_grad_norm_for_trainer_answers_isfinite_and_is_plain_otherwise():
    norm = GradNormForTrainer.wrap(torch.tensor(float("inf")))
    finite = torch.isfinite(norm)
    assert finite.device.type == "cpu" and bool(finite.all())  # what the trainer asks
    assert bool(norm.isfinite())
    for derived in (norm * 1.0, norm > 0.1, torch.where(norm > 0.1, norm.new_tensor(100),
                                                        norm.new_tensor(0)), norm.cpu()):
        assert type(derived) is torch.Tensor
    assert type(copy.deepcopy(norm)) is torch.Tensor
    assert type(pickle.loads(pickle.dumps(norm))) is torch.Tensor
    buf = io.BytesIO()  # checkpoints keep fairseq's meters, which keep the last logged value
    with metrics.aggregate(new_root=True) as agg:
        metrics.log_scalar("gnorm", GradNormForTrainer.wrap(torch.tensor(0.25)), round=3)
        torch.save(agg.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    (meter_state,) = [state for _, key, _, state in loaded if key == "gnorm"]
    assert type(meter_state["val"]) is torch.Tensor and float(meter_state["val"]) == 0.25


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_guarded_factor_is_fairseqs_clip_or_nan(max_norm):
    for total, mf in ((0.3, 0.25), (10.0, 0.25), (float("inf"), 0.25), (float("nan"), 1.0),
                      (4.0, torch.tensor(0.5))):
        norm, factor = guarded_factor(torch.tensor(total), mf, max_norm)
        expect_norm = total * float(mf)
        assert float(norm) == pytest.approx(expect_norm, rel=1e-6, nan_ok=True)
        if expect_norm != expect_norm or expect_norm == float("inf"):
            assert torch.isnan(factor)
        elif expect_norm > max_norm > 0:
            assert float(factor) == pytest.approx(float(mf) * max_norm / expect_norm, rel=1e-6)
        else:
            assert float(factor) == pytest.approx(float(mf), rel=1e-6)


@pytest.mark.parametrize("extra, flag", [
    (["--ls-deferred-overflow-check", "--ls-no-fused-fp16-copy"], "--ls-no-fused-fp16-copy"),
    (DEFERRED + ["--fp16-adam-stats"], "--fp16-adam-stats"),
])
def test_unsupported_combinations_are_clear_errors(extra, flag):
    with pytest.raises(ValueError, match=flag):
        _build("ls_adam", extra)


def test_on_by_default():
    _, opt = _build("ls_adam", [])
    assert isinstance(opt, LSFusedFP16Optimizer) and opt.defers_host_reads
    _, opt = _build("ls_adam", ["--ls-no-deferred-overflow-check"])
    assert isinstance(opt, LSFusedFP16Optimizer) and not opt.defers_host_reads
    _, opt = _build("ls_adam", ["--ls-no-fused-fp16-copy"])
    assert type(opt) is FP16Optimizer


class _UpdateCount:
    """The part of fairseq's Trainer that patch 8 reads and writes: its optimizer and
    update count."""

    def __init__(self, optimizer):
        self._optimizer, self.count = optimizer, 0

    def get_num_updates(self):
        return self.count

    def set_num_updates(self, n):
        self.count = n


def _counted_run(opt, params, steps, overflow_at):
    """fairseq's trainer around ``opt`` with its update count: +1 after every update whose
    clip_grad_norm did not raise OverflowError; patch 8's take-back right after clip_grad_norm.
    Returns the count each step that updated the weights ran at (what sets its learning rate),
    and the final count."""
    trainer, counts = _UpdateCount(opt), []
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        opt.zero_grad()
        coef = [torch.randn(p.shape, generator=g) * 0.01 for p in params]
        if step in overflow_at:
            coef[0].view(-1)[2] = float("inf")
        opt.backward(sum((p.float() * c).sum() for p, c in zip(params, coef)))
        opt.multiply_grads(0.5)
        try:
            opt.clip_grad_norm(0.0)
        except OverflowError:
            continue
        take_back_skipped_updates(trainer)
        if step not in overflow_at:  # the deferred check's overflowing steps change nothing
            counts.append(trainer.get_num_updates())
        opt.step()
        trainer.set_num_updates(trainer.get_num_updates() + 1)
    return counts, trainer.count


@pytest.mark.parametrize("overflow_at", [(2,), (3, 4, 9), (0, 1)])
def test_skipped_updates_are_taken_back_from_the_trainers_count(overflow_at):
    """fairseq's trainer does not count an update that overflowed. With the deferred check the
    trainer counts it (nobody knows yet); the next update's booking finds the overflow and
    patch 8 takes it back before the optimizer step: every real step runs at fairseq's update
    count (its learning rate), and the count ends where fairseq's does."""
    extra = ["--fp16-scale-window", "3"]
    ref_params, ref = _build("adam", extra)
    params, opt = _build("ls_adam", extra + DEFERRED)
    ref_counts, ref_total = _counted_run(ref, ref_params, 12, overflow_at)
    counts, total = _counted_run(opt, params, 12, overflow_at)
    last_taken_back = 11 not in overflow_at  # an overflow on the last update is booked later
    assert ref_counts == list(range(12 - len(overflow_at)))
    assert counts == ref_counts
    assert total == ref_total if last_taken_back else ref_total + 1
    assert opt.take_skipped_updates() == 0  # each skipped update taken back once


def test_bf16_without_the_fused_copy_trains_as_fairseq():
    """ls_adam takes fairseq's step-with-scale route; without a loss scaler fairseq's wrapper
    never resets the gradients' multiply factor, which then shrinks by 1 / sample_size every
    update until the run stops training and fails (ZeroDivisionError). ls_adam without the
    fused copy under --bf16 gets LSFP16Optimizer, which resets it: fairseq's adam updates."""
    ref_params, ref = _build_bf16("adam", [])
    params, opt = _build_bf16("ls_adam", ["--ls-no-fused-fp16-copy"])
    assert type(opt) is LSFP16Optimizer and opt.scaler is None
    for o, ps in ((ref, ref_params), (opt, params)):
        g = torch.Generator().manual_seed(5)
        for _ in range(40):
            o.zero_grad()
            o.backward(sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in ps))
            o.multiply_grads(1.0 / 3000)  # 1 / sample_size: 40 updates take 3000^-40 to 0
            o.clip_grad_norm(0.0)
            o.step()
    for a, b in zip(ref.fp32_params, opt.fp32_params):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def _build_bf16(optimizer, extra):
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in _params()]
    cfg = fp16_optimizer_cfg(optimizer, ["--fp16-no-flatten-grads", *extra])
    cfg.common.fp16, cfg.common.bf16 = False, True  # what --bf16 gives (ls_ archs: no --tpu)
    return params, FP16Optimizer.build_optimizer(cfg, params)


def test_bf16_matches_fairseq_and_stops_one_update_late_on_non_finite_gradients():
    """--bf16: no loss scaler. The deferred check reads nothing back; its updates are fairseq's
    (bf16 weights within one bf16 ulp: the fp32 masters agree to 1e-6), and a non-finite grad
    norm, which fairseq's trainer turns into FloatingPointError at once, raises it at the next
    update's backward, the bad update itself skipped on the device."""
    ref_params, ref = _build_bf16("adam", [])
    params, opt = _build_bf16("ls_adam", [])
    assert isinstance(opt, LSFusedFP16Optimizer) and opt.defers_host_reads and opt.scaler is None
    _, ref_norms = fp16_trainer_run(ref, ref_params, 6, 1)
    _, norms = fp16_trainer_run(opt, params, 6, 1)
    for a, b in zip(ref_norms, norms):
        assert float(b) == pytest.approx(float(a), rel=1e-5)
    for a, b in zip(ref.fp32_params, opt.fp32_params):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(ref_params, params):
        assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=0)
    before = [p.detach().clone() for p in opt.fp32_params]
    with pytest.raises(FloatingPointError, match="gradients are Nan/Inf"):
        fp16_trainer_run(opt, params, 2, 2, overflow_at=(0,))
    for a, b in zip(before, opt.fp32_params):
        assert torch.equal(a, b)
