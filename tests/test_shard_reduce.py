"""ops.shard_reduce (the sum step of the copy-engine all-reduce), reference path on the CPU.

What it must equal: fairseq's legacy all-reduce of the same shard (LegacyDistributedDataParallel:
each rank's gradient divided by the world size in its dtype, then summed by NCCL in that dtype).
On 2 ranks both are one rounding of (a + b) / 2, so float16 and bfloat16 agree bit for bit on
normal numbers; on more ranks the legacy sum rounds at every addition and ours once, so they may
differ by the legacy sum's own rounding error (bounded below by comparing both with float64).
The kernel is tested against this reference on the GPU (tests/gpu/test_shard_reduce_cuda.py).
"""
import pytest
import torch

from ls_fairseq.ops.shard_reduce import shard_reduce_, shard_reduce_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SIZES = (0, 1, 7, 16, 1000, 4099)


def _ranks(world, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # gradients of mixed sign and magnitude (0.018 to 55), far from the dtypes' subnormals, with
    # exponents close enough that float32 holds any sum of two of them exactly
    def one():
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        return (sign * torch.exp(torch.rand(n, generator=g) * 8 - 4)).to(dtype)
    return [one() for _ in range(world)]


def _legacy(xs):
    """fairseq's legacy all-reduce of one element block: x / world in the dtype, summed in it."""
    world = len(xs)
    total = xs[0] / world
    for x in xs[1:]:
        total = total + x / world
    return total


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_two_ranks_equal_fairseq_legacy_all_reduce(dtype, n):
    a, b = _ranks(2, n, dtype)
    out = a.clone()
    shard_reduce_(out, [b], 0.5)
    assert torch.equal(out, _legacy([a, b]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", (3, 4, 5, 8))
def test_more_ranks_no_further_from_the_mean_than_legacy(dtype, world):
    xs = _ranks(world, 4099, dtype, seed=world)
    out = xs[0].clone()
    shard_reduce_(out, xs[1:], 1.0 / world)
    truth = torch.stack([x.double() for x in xs]).sum(0) / world
    magnitude = torch.stack([x.double().abs() for x in xs]).sum(0) / world
    ours = (out.double() - truth).abs()
    legacy = (_legacy(xs).double() - truth).abs()
    # one rounding into the dtype (half an ulp of the result) after a float32 sum of `world`
    # terms (at most world float32 roundings of partial sums no larger than `magnitude`)
    f32 = torch.finfo(torch.float32).eps
    bound = 0.5 * torch.finfo(dtype).eps * truth.abs() + world * f32 * magnitude
    assert bool((ours <= bound).all())
    if dtype != torch.float32:  # the legacy chain rounds in 16 bits at every addition
        assert ours.sum() < legacy.sum()


@pytest.mark.parametrize("dtype", DTYPES)
def test_order_and_in_place(dtype):
    xs = _ranks(4, 257, dtype, seed=7)
    out = xs[0].clone()
    ret = shard_reduce_(out, xs[1:], 0.25)
    assert ret is out
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    assert torch.equal(out, (acc * 0.25).to(dtype))
    assert torch.equal(shard_reduce_reference(xs[0].clone(), xs[1:], 0.25), out)


def test_no_parts_scales():
    x = torch.tensor([2.0, -4.0, 6.0], dtype=torch.float16)
    shard_reduce_(x, [], 0.5)
    assert x.tolist() == [1.0, -2.0, 3.0]
