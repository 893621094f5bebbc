"""CPU: the chunked output projection + CE against fairseq's unfused path.

Reference = fairseq's own ``label_smoothed_nll_loss`` on ``log_softmax((hidden @ W.T).float())``
with autograd for the gradients w.r.t. hidden and W. Fresh random inputs per case; odd vocab and
token counts, chunk sizes that do and do not divide the token count, padding rows. The custom op
``ls_fairseq::fused_output_cross_entropy_fwd`` itself: ``torch.library.opcheck`` (schema, autograd
registration, fake, AOT autograd), gradients computed only for the inputs that need them, a
retained graph's second backward. Its kernel branch (the CE kernels per chunk) runs over CPU
stand-ins in tests/cross_entropy_autograd_check.py.
"""
import pytest
import torch
from dispatch_trace import fills_in_backward
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from ls_fairseq.ops import fused_output_cross_entropy as fused_module
from ls_fairseq.ops.fused_output_cross_entropy import (
    default_chunk_size,
    fused_output_cross_entropy,
    fused_output_cross_entropy_fwd,
)


def _reference(hidden, weight, target, eps, pad):
    logits = hidden @ weight.t()
    lprobs = torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, -1)
    loss, nll = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=pad, reduce=True)
    return loss, nll, logits


def _inputs(n, d, v, dtype, pad, pad_frac, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, d, generator=g) * 2).to(dtype)
    weight = (torch.randn(v, d, generator=g) / d**0.5).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    if pad is not None:
        target[torch.rand(n, generator=g) < pad_frac] = pad
    return hidden, weight, target


CASES = [
    # n, d, v, chunk, eps, pad
    (37, 16, 53, 8, 0.1, 1),
    (37, 16, 53, None, 0.1, 1),
    (64, 24, 101, 64, 0.0, 2),
    (65, 24, 101, 1, 0.2, None),
    (5, 8, 2, 3, 0.1, 0),
    (200, 32, 331, 37, 0.1, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,d,v,chunk,eps,pad", CASES)
def test_matches_fairseq_forward_and_backward(n, d, v, chunk, eps, pad, dtype):
    hidden, weight, target = _inputs(n, d, v, dtype, pad, 0.3, seed=n * 1000 + v)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    upstream = 3.7  # the loss is linear in the upstream gradient: check it is applied

    ref_loss, ref_nll, logits = _reference(h1, w1, target, eps, pad)
    (ref_loss * upstream).backward()
    loss, nll, n_correct = fused_output_cross_entropy(
        h2, w2, target, eps, pad, chunk_size=chunk, compute_accuracy=True)
    (loss * upstream).backward()

    # fp32: sums of N rows of fp32 log-softmax in another order -> ~1e-6 relative; fp64: ~1e-13.
    tol = dict(rtol=2e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-11)
    assert loss.dtype == dtype and nll.dtype == dtype
    torch.testing.assert_close(loss.double(), ref_loss.double(), **tol)
    torch.testing.assert_close(nll.double(), ref_nll.double(), **tol)
    gtol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(h2.grad, h1.grad, **gtol)
    torch.testing.assert_close(w2.grad, w1.grad, **gtol)

    mask = target.ne(pad) if pad is not None else torch.ones_like(target, dtype=torch.bool)
    expected_correct = (logits.argmax(-1).eq(target) & mask).sum()
    assert int(n_correct) == int(expected_correct)


def test_shared_weight_gradients_accumulate():
    """The output weight is usually the (shared) target embedding: both grads must add up."""
    n, d, v, pad = 43, 12, 29, 1
    hidden, weight, target = _inputs(n, d, v, torch.float64, pad, 0.2, seed=7)
    tokens = torch.randint(0, v, (11,))

    def run(fused):
        w = weight.clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        emb = torch.nn.functional.embedding(tokens, w).sum()
        if fused:
            loss, _, _ = fused_output_cross_entropy(h, w, target, 0.1, pad, chunk_size=10)
        else:
            loss, _, _ = _reference(h, w, target, 0.1, pad)
        (loss + emb).backward()
        return h.grad, w.grad

    (gh_f, gw_f), (gh_r, gw_r) = run(True), run(False)
    torch.testing.assert_close(gh_f, gh_r, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(gw_f, gw_r, rtol=1e-9, atol=1e-10)


def test_three_dim_hidden_and_no_grad():
    b, t, d, v, pad = 3, 7, 10, 23, 1
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(b, t, d, generator=g)
    weight = torch.randn(v, d, generator=g) * 0.3
    target = torch.randint(0, v, (b, t), generator=g)
    target[0, 5:] = pad
    with torch.no_grad():
        loss, nll, _ = fused_output_cross_entropy(hidden, weight, target, 0.1, pad, chunk_size=4)
    ref_loss, ref_nll, _ = _reference(hidden.reshape(-1, d), weight, target.reshape(-1), 0.1, pad)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(nll, ref_nll, rtol=2e-5, atol=1e-5)
    assert not loss.requires_grad


def test_only_hidden_requires_grad():
    hidden, weight, target = _inputs(19, 6, 13, torch.float64, 1, 0.2, seed=11)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    _reference(h1, weight, target, 0.1, 1)[0].backward()
    fused_output_cross_entropy(h2, weight, target, 0.1, 1, chunk_size=5)[0].backward()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-9, atol=1e-10)


def test_backward_makes_no_zero_gradients():
    """nll, n_correct and the saved gradients are outputs without gradients: the backward gets
    None for them, not zero tensors of the hidden's and the weight's shapes (float32)."""
    hidden, weight, target = _inputs(37, 16, 53, torch.float32, 1, 0.2, seed=5)
    hidden.requires_grad_(), weight.requires_grad_()
    loss = fused_output_cross_entropy(hidden, weight, target, 0.1, 1, chunk_size=8)[0]
    assert fills_in_backward(loss, torch.ones(())) == []
    assert hidden.grad is not None and weight.grad is not None


def test_bfloat16_close_to_fp32_reference():
    """bf16 storage: logits and gradients are rounded to bf16 (8-bit mantissa) -> ~1e-2."""
    hidden, weight, target = _inputs(50, 16, 77, torch.float32, 1, 0.2, seed=5)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_loss, _, _ = _reference(h1, w1, target, 0.1, 1)
    ref_loss.backward()
    h2 = hidden.bfloat16().requires_grad_()
    w2 = weight.bfloat16().requires_grad_()
    loss, _, _ = fused_output_cross_entropy(h2, w2, target, 0.1, 1, chunk_size=16)
    loss.backward()
    assert h2.grad.dtype == torch.bfloat16 and w2.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=1e-2)
    for got, ref in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        err = (got.float() - ref).norm() / ref.norm()
        assert err < 2e-2, err


def test_default_chunk_size():
    assert default_chunk_size(100, 40000, torch.float16) == 100
    c = default_chunk_size(10**6, 40000, torch.float16)
    assert 1 <= c < 10**6 and c % 64 == 0
    assert default_chunk_size(10, 10**12, torch.float32) == 1


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        fused_output_cross_entropy(torch.randn(4, 5), torch.randn(7, 6), torch.zeros(4).long(), 0.1, 1)
    with pytest.raises(ValueError):
        fused_output_cross_entropy(torch.randn(4, 5), torch.randn(1, 5), torch.zeros(4).long(), 0.1, 1)


@pytest.mark.parametrize("dtype,grads,chunk,pad", [
    (torch.float32, (True, True), 4, 1),
    (torch.float64, (True, False), None, 1),
    (torch.bfloat16, (False, True), 3, -(2**63)),  # ignore_index=None
    (torch.float32, (False, False), 5, 2),
])
def test_opcheck(dtype, grads, chunk, pad):
    """Schema, autograd registration, fake implementation and AOT autograd of the op, with and
    without accuracy and for each set of gradients asked for."""
    hidden, weight, target = _inputs(11, 8, 13, dtype, 1 if pad == -(2**63) else pad, 0.3, seed=4)
    args_of = lambda acc: (hidden.clone().requires_grad_(grads[0]),  # noqa: E731
                           weight.clone().requires_grad_(grads[1]), target, 0.1, pad, chunk, acc,
                           *grads)
    for acc in (True, False):
        torch.library.opcheck(fused_output_cross_entropy_fwd, args_of(acc))


def test_gradients_only_where_needed(monkeypatch):
    """The forward computes the gradient of each input that requires grad while grad mode is
    on, and no other: none under torch.no_grad, nothing for a frozen weight."""
    hidden, weight, target = _inputs(19, 6, 13, torch.float64, 1, 0.2, seed=12)
    seen = []
    real = fused_module._chunk_loss_and_grad

    def spy(logits, target, epsilon, ignore_index, need_grad, grad_scale, compute_argmax):
        seen.append(need_grad)
        return real(logits, target, epsilon, ignore_index, need_grad, grad_scale, compute_argmax)

    monkeypatch.setattr(fused_module, "_chunk_loss_and_grad", spy)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.no_grad():
        loss, _, _ = fused_output_cross_entropy(h, w, target, 0.1, 1, chunk_size=5)
    assert not loss.requires_grad and seen == [False] * 4
    with_grad = fused_output_cross_entropy(h, w, target, 0.1, 1, chunk_size=5)[0]
    assert torch.equal(with_grad.detach(), loss)  # the same sums either way
    out = fused_output_cross_entropy_fwd(hidden, w, target, 0.1, 1, 5, False, False, True)
    assert out[3].numel() == 0 and out[4].shape == weight.shape  # frozen hidden: no grad_h
    seen.clear()
    fused_output_cross_entropy(hidden, weight, target, 0.1, 1, chunk_size=5)
    assert seen == [False] * 4
    # an input that requires grad whose gradient was not asked for: refused, not silently None
    bad = fused_output_cross_entropy_fwd(h, w, target, 0.1, 1, 5, False, True, False)[0]
    with pytest.raises(RuntimeError, match="not asked for"):
        bad.backward()


def test_second_backward_with_retained_graph():
    """The backward scales the saved gradients out of place: a retained graph's second backward
    adds the same gradients again."""
    hidden, weight, target = _inputs(23, 8, 17, torch.float64, 1, 0.2, seed=13)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_output_cross_entropy(h, w, target, 0.1, 1, chunk_size=6)[0]
    loss.backward(retain_graph=True)
    first_h, first_w = h.grad.clone(), w.grad.clone()
    loss.backward()
    assert torch.equal(h.grad, 2 * first_h) and torch.equal(w.grad, 2 * first_w)


# ---- the criterion option --ls-fused-output-ce against fairseq's criterion ---------------------

TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "24", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--dropout", "0"]


@pytest.mark.parametrize("ignore_prefix_size", [0, 2])
@pytest.mark.parametrize("share", [True, False])
def test_criterion_option_matches_fairseq(ignore_prefix_size, share):
    from fairseq.criterions.label_smoothed_cross_entropy import (
        LabelSmoothedCrossEntropyCriterion,
    )
    from fairseq_helpers import (DummyTask, build_model, make_dictionary, max_rel_err,
                                 random_sample, run_criterion)
    from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
        LSLabelSmoothedCrossEntropyCriterion,
    )

    d = make_dictionary(45)
    task = DummyTask(d)
    kwargs = dict(sentence_avg=False, label_smoothing=0.1, ignore_prefix_size=ignore_prefix_size,
                  report_accuracy=True)
    ref_crit = LabelSmoothedCrossEntropyCriterion(task, **kwargs)
    ls_crit = LSLabelSmoothedCrossEntropyCriterion(task, **kwargs, ls_fused_output_ce=True,
                                                   ls_fused_output_ce_chunk=7)
    extra = TINY + (["--share-all-embeddings"] if share else [])
    model = build_model("ls_transformer", d, extra, seed=5).double()
    sample = random_sample(d, 4, 6, 9, torch.Generator().manual_seed(1))

    ref_loss, ref_size, ref_log, ref_grads = run_criterion(ref_crit, model, sample)
    loss, size, log, grads = run_criterion(ls_crit, model, sample)

    # fairseq's criterion takes log_softmax in fp32 (utils.log_softmax upcasts to float), ours
    # in fp64 for this fp64 model: agreement to fp32 rounding (the rule of test_criterion.py).
    assert size == ref_size
    assert max_rel_err(loss, ref_loss) <= 1e-6
    assert max_rel_err(log["nll_loss"], ref_log["nll_loss"]) <= 1e-6
    for key in ("ntokens", "nsentences", "sample_size", "n_correct", "total"):
        assert log[key] == ref_log[key], key
    for key, grad in grads.items():
        if ref_grads[key].abs().max() < 1e-12:  # e.g. k_proj.bias: zero up to rounding
            assert grad.abs().max() < 1e-12, key
            continue
        assert max_rel_err(grad, ref_grads[key]) <= 1e-5, key
