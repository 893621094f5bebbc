"""The whole ls_ model on the GPU (fused kernels) vs fairseq's transformer with the same weights.

fp32: kernels compute in fp32 but reduce in other orders than PyTorch/cuDNN, and fp32 GEMMs run
without TF32 (torch's default), so outputs agree to ~1e-6; tolerance 1e-4 (relative to the
tensor's max). fp16: compared against fairseq in fp32 (the truth), ls_ must be no less accurate
than fairseq in fp16 (see the test's docstring).
"""
import copy

import pytest
import torch

from fairseq_helpers import build_pair, random_batch  # noqa: E402

# ``dictionary`` (203 symbols) and ``kernels_required`` come from tests/gpu/conftest.py
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_required")]

TINY = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
    "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "136", "--decoder-ffn-embed-dim",
    "136", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0",
    "--attention-dropout", "0", "--activation-dropout", "0",
]
CONFIGS = {
    "post_ln": ("transformer", TINY + ["--share-all-embeddings"]),
    "pre_ln_t2t": ("transformer_wmt_en_de_big_t2t", TINY + ["--share-all-embeddings"]),
    "gelu_learned": ("transformer_wmt_en_de_big", TINY + ["--activation-fn", "gelu",
                                                          "--encoder-learned-pos",
                                                          "--decoder-learned-pos"]),
}


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _grad_errors(model, truth):
    """Per-parameter gradient error of ``model`` against ``truth`` (relative to the tensor's
    max; q/k projections relative to their block's v projection, see test_model_equivalence)."""
    params = dict(model.named_parameters())
    # gradients that are exactly zero in exact arithmetic (e.g. the query path of a cross
    # attention over a single key) hold rounding noise only: floor the scale at 1e-3 x the
    # model's largest gradient
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in truth.parameters())
    errors = {}
    for key, p in truth.named_parameters():
        scale = max(float(p.grad.abs().max()), floor)
        if ".k_proj." in key or ".q_proj." in key:
            scale = max(scale, truth.get_parameter(
                key.replace(".k_proj.", ".v_proj.").replace(".q_proj.", ".v_proj.")).grad.abs().max())
        diff = (params[key].grad.double() - p.grad.double()).abs().max()
        errors[key] = float(diff / max(float(scale), 1e-30))
    return errors


def _run(model, batch, upstream):
    out, _ = model(*batch)
    (out.float() * upstream).sum().backward()
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(8, 37, 29), (3, 1, 5), (16, 130, 7)])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_model_matches_fairseq_on_gpu(dictionary, name, dtype, shape, seed):
    """fp32: ls_ within 1e-4 (outputs) / 1e-3 (gradients) of fairseq. fp16: both sides round to
    fp16 at different points, so neither equals the other; the criterion is that ls_ in fp16 is
    no further from the fp32 truth (fairseq in fp32) than fairseq in fp16 is, with a 2x margin
    on outputs, 4x on gradients (reduction orders differ inside fused backward kernels), plus
    1e-3 / 1e-2 absolute slack for tensors where fairseq's own fp16 error happens to be tiny.
    A real defect (wrong mask, scale, missing term) gives errors of order 1 and fails.

    fp16 runs the feed-forward with GELU instead of ReLU (``_FP16_SMOOTH``). ReLU's derivative
    jumps at 0: a pre-activation within fp16 rounding of 0 takes opposite signs in two fp16
    computations that round at different points, and that switches one unit's whole gradient
    path on or off, an O(1) change of every upstream gradient at that position. Which run hits
    such a tie is luck, not accuracy. Measured on H100 (session 21, pre_ln_t2t (8, 37, 29)):
    the short and efficient backends each flipped 12-16 pre-activations of |h| <= 1e-3 against
    the fp32 truth, and each of the three backends failed the ReLU version of this check at a seed
    (short at seed 11: encoder.layers.1.fc1.weight 0.40 of its max, 0.03 once the one flipped
    unit is left out; efficient at seed 13; softmax at seed 11), while fairseq's own fp16, which
    rounds where the fp32 truth does, passed. GELU has a continuous derivative, so rounding
    moves gradients by rounding amounts only. fp32 keeps ReLU (no such ties at 1e-6), and the
    fp16 ReLU kernel is checked on its own against fairseq in the bias_act_dropout tests."""
    _check_model(dictionary, name, dtype, shape, seed)


# Each attention backend forced through the whole model (auto runs "short" where rows are at
# most 128, test_short_attention_cuda.py; these run the others end to end in fp16).
@pytest.mark.parametrize("backend", ["efficient", "softmax"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", [(8, 37, 29), (3, 1, 5), (16, 130, 7)])
def test_model_with_each_attention_backend(dictionary, name, shape, backend, monkeypatch):
    from ls_fairseq.ops import _attention_cuda as ac

    monkeypatch.setenv(ac.ENV_VAR, backend)
    _check_model(dictionary, name, torch.float16, shape)


# see test_model_matches_fairseq_on_gpu's docstring: ReLU ties make fp16 gradient checks luck
_FP16_SMOOTH = ["--activation-fn", "gelu"]


def build_case(dictionary, name, dtype, shape, seed=11, extra=(), batch_seed=None):
    """(fp32 fairseq truth, fairseq in ``dtype``, ls_ in ``dtype``, batch, upstream gradient):
    config ``name`` with ``extra`` flags, the same weights in all three, a random padded batch of
    ``shape`` (generator seeded with ``batch_seed``, default ``sum(shape) + seed``)."""
    arch, flags = CONFIGS[name]
    ref, ls = build_pair(arch, dictionary, flags + list(extra), seed=seed)
    ls.load_state_dict(ref.state_dict())
    truth = copy.deepcopy(ref).cuda().train()
    ref, ls = ref.cuda().to(dtype).train(), ls.cuda().to(dtype).train()
    g = torch.Generator().manual_seed(sum(shape) + seed if batch_seed is None else batch_seed)
    src, src_lengths, prev, _ = random_batch(dictionary, *shape, generator=g)
    batch = (src.cuda(), src_lengths.cuda(), prev.cuda())
    upstream = torch.randn(src.size(0), prev.size(1), len(dictionary), generator=g).cuda()
    return truth, ref, ls, batch, upstream


def _check_model(dictionary, name, dtype, shape, seed=11):
    truth, ref, ls, batch, upstream = build_case(
        dictionary, name, dtype, shape, seed, extra=_FP16_SMOOTH if dtype != torch.float32 else ())
    truth_out = _run(truth, batch, upstream)
    ref_out = _run(ref, batch, upstream)
    ls_out = _run(ls, batch, upstream)
    assert torch.isfinite(ls_out).all()
    ls_grad, ref_grad = _grad_errors(ls, truth), _grad_errors(ref, truth)
    if dtype == torch.float32:
        assert rel(ls_out, truth_out) <= 1e-4
        worst = max(ls_grad.items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-3, worst
    else:
        assert rel(ls_out, truth_out) <= 2 * rel(ref_out, truth_out) + 1e-3
        excess = sorted(((err / (4 * ref_grad[key] + 1e-2), key, err, ref_grad[key])
                         for key, err in ls_grad.items()), reverse=True)
        assert excess[0][0] <= 1, ("gradient error over tolerance (ratio, name, ls_ err, fairseq "
                                   "err), worst first", excess[:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_incremental_decoding_matches_fairseq_on_gpu(dictionary, dtype):
    ref, ls = build_pair("transformer_wmt_en_de_big_t2t", dictionary,
                         CONFIGS["pre_ln_t2t"][1], seed=5)
    ls.load_state_dict(ref.state_dict())
    ref, ls = ref.cuda().to(dtype).eval(), ls.cuda().to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    src, src_lengths, _, _ = random_batch(dictionary, 6, 11, 3, generator=g)
    src, src_lengths = src.cuda(), src_lengths.cuda()
    prev = torch.randint(4, len(dictionary), (6, 9), generator=g).cuda()
    prev[:, 0] = dictionary.eos()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        ref_enc, ls_enc = ref.encoder(src, src_lengths), ls.encoder(src, src_lengths)
        ref_state, ls_state = {}, {}
        for t in range(1, prev.size(1) + 1):
            a, _ = ref.decoder(prev[:, :t], ref_enc, incremental_state=ref_state)
            b, _ = ls.decoder(prev[:, :t], ls_enc, incremental_state=ls_state)
            assert rel(b, a) <= tol, t


def test_dropout_training_is_reproducible_and_finite(dictionary):
    arch = "transformer_wmt_en_de_big_t2t"
    extra = TINY[:-6] + ["--dropout", "0.3", "--attention-dropout", "0.1",
                         "--activation-dropout", "0.1", "--share-all-embeddings"]
    _, ls = build_pair(arch, dictionary, extra, seed=2)
    ls = ls.cuda().half().train()
    g = torch.Generator().manual_seed(0)
    src, src_lengths, prev, _ = random_batch(dictionary, 8, 40, 33, generator=g)
    src, src_lengths, prev = src.cuda(), src_lengths.cuda(), prev.cuda()
    outs = []
    for seed in (123, 123, 124):
        torch.manual_seed(seed)
        outs.append(ls(src, src_lengths, prev)[0])
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_two_models_in_one_process(dictionary):
    _, a = build_pair("transformer", dictionary, CONFIGS["post_ln"][1], seed=1)
    _, b = build_pair("transformer", dictionary, CONFIGS["post_ln"][1], seed=2)
    a, b = a.cuda().eval(), b.cuda().eval()
    g = torch.Generator().manual_seed(0)
    src, src_lengths, prev, _ = random_batch(dictionary, 4, 9, 6, generator=g)
    src, src_lengths, prev = src.cuda(), src_lengths.cuda(), prev.cuda()
    with torch.no_grad():
        a1 = a(src, src_lengths, prev)[0]
        b1 = b(src, src_lengths, prev)[0]
        a2 = a(src, src_lengths, prev)[0]
    assert torch.equal(a1, a2) and not torch.allclose(a1, b1)
