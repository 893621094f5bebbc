"""The whole ls_ model on the GPU (fused kernels) vs fairseq's transformer with the same weights.

fp32: kernels compute in fp32 but reduce in other orders than PyTorch/cuDNN, and fp32 GEMMs run
without TF32 (torch's default), so outputs agree to ~1e-6; tolerance 1e-4 (relative to the
tensor's max). fp16: both sides round activations to fp16 at different points (fused ops keep
fp32 inside a kernel), so errors are of the order of fp16's 1e-3 resolution amplified through the
layers; tolerance 2e-2 on outputs and 5e-2 on gradients, relative to the tensor's max.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fairseq_helpers import build_pair, make_dictionary, random_batch  # noqa: E402

pytestmark = pytest.mark.gpu

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


@pytest.fixture(scope="module")
def dictionary():
    return make_dictionary(203)


@pytest.fixture(autouse=True)
def kernels_required(monkeypatch):
    monkeypatch.setenv("LS_FAIRSEQ_KERNELS", "require")


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype,fwd_tol,grad_tol", [(torch.float32, 1e-4, 1e-3),
                                                    (torch.float16, 2e-2, 5e-2)])
@pytest.mark.parametrize("shape", [(8, 37, 29), (3, 1, 5), (16, 130, 7)])
def test_model_matches_fairseq_on_gpu(dictionary, name, dtype, fwd_tol, grad_tol, shape):
    arch, extra = CONFIGS[name]
    ref, ls = build_pair(arch, dictionary, extra, seed=11)
    ls.load_state_dict(ref.state_dict())
    ref, ls = ref.cuda().to(dtype).train(), ls.cuda().to(dtype).train()
    g = torch.Generator().manual_seed(sum(shape))
    src, src_lengths, prev, _ = random_batch(dictionary, *shape, generator=g)
    src, src_lengths, prev = src.cuda(), src_lengths.cuda(), prev.cuda()
    ref_out, _ = ref(src, src_lengths, prev)
    ls_out, _ = ls(src, src_lengths, prev)
    assert torch.isfinite(ls_out).all()
    assert rel(ls_out, ref_out) <= fwd_tol
    upstream = torch.randn(ref_out.shape, generator=g).to(ref_out)
    (ref_out.float() * upstream).sum().backward()
    (ls_out.float() * upstream).sum().backward()
    ls_params = dict(ls.named_parameters())
    for key, p in ref.named_parameters():
        q = ls_params[key]
        scale = p.grad.abs().max()
        if ".k_proj." in key or ".q_proj." in key:  # see tests/test_model_equivalence.py
            scale = max(scale, ref.get_parameter(
                key.replace(".k_proj.", ".v_proj.").replace(".q_proj.", ".v_proj.")).grad.abs().max())
        err = float((q.grad.double() - p.grad.double()).abs().max() / max(float(scale), 1e-30))
        assert err <= grad_tol, (key, err)


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
