"""The shard_reduce_ kernel (csrc/shard_reduce.cu) against its reference (ops/shard_reduce.py).

Both accumulate in float32 in the same order and round once, so they agree bit for bit: every
dtype, sizes around the 16-byte vector width, 0 to 15 parts, and 16-byte-misaligned tensors (the
scalar path). torch.library.opcheck checks the op's schema and fake.
"""
import pytest
import torch

from ls_fairseq.ops import _shard_reduce_cuda as cuda
from ls_fairseq.ops.shard_reduce import shard_reduce_, shard_reduce_reference

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module", autouse=True)
def _kernels(extension):
    assert extension.has_op("shard_reduce_")


def _inputs(n, k, dtype, misaligned, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shift = 1 if misaligned else 0
    xs = [torch.randn(n + shift, device="cuda", generator=g).mul_(100).to(dtype)[shift:]
          for _ in range(k + 1)]
    return xs[0], xs[1:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 7, 8, 9, 4095, 1 << 20))
@pytest.mark.parametrize("k", (0, 1, 3, 7, 15))
@pytest.mark.parametrize("misaligned", (False, True))
def test_kernel_equals_reference(dtype, n, k, misaligned):
    out, parts = _inputs(n, k, dtype, misaligned, seed=n + k)
    assert cuda.supports(out, parts)
    ref = shard_reduce_reference(out.clone(), parts, 1.0 / (k + 1))
    cuda.shard_reduce_cuda(out, parts, 1.0 / (k + 1))
    assert torch.equal(out, ref)


def test_public_entry_dispatches_and_falls_back():
    out, parts = _inputs(4096, 16, torch.float16, False)  # 16 parts: beyond the kernel's 15
    assert not cuda.supports(out, parts)
    ref = shard_reduce_reference(out.clone(), parts, 1 / 17)
    assert torch.equal(shard_reduce_(out, parts, 1 / 17), ref)


def test_empty_is_a_no_op():
    out = torch.empty(0, device="cuda", dtype=torch.float16)
    cuda.shard_reduce_cuda(out, [out.clone()], 0.5)


def test_opcheck():
    out, parts = _inputs(1031, 3, torch.float16, False)
    torch.library.opcheck(torch.ops.ls_fairseq.shard_reduce_.default, (out, parts, 0.25))
