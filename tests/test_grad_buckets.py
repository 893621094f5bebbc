"""The bucketed gradient all-reduce (ls_fairseq/distributed/grad_buckets.py) on the CPU.

The bucket plan must tile every flat buffer exactly (padding included), keep each parameter in one
bucket and order the buckets from the end of the buffers (the backward's order). Reducing the
buckets with ``legacy_reduce`` (two gloo processes) must give bitwise fairseq's
``LegacyDistributedDataParallel.all_reduce_grads`` (same division, a two-rank sum is order-free),
and ls_adam's ``all_reduce_grads`` must then leave the buffers alone (no second reduction) when
the model's ``FlatGradients`` say ``all_reduced``.
The CUDA side (events inside the captured backward, the side stream) is tested on the GPU in
tests/gpu/test_cuda_graphs_cuda.py."""
import pytest
import torch
import torch.distributed as dist
from fairseq.distributed import LegacyDistributedDataParallel, ModuleProxyWrapper

from fairseq_helpers import run_workers

from ls_fairseq.distributed import (
    REDUCED, GradientExchange, GradientReducer, exchange, exchange_of, grad_buckets,
)
from ls_fairseq.graphs.flat_gradients import FlatGradients
from ls_fairseq.optim.ls_adam import FairseqLSAdam, LSAdamConfig

WORLD = 2


def _layout(sizes, align=16):
    spans, total = [], 0
    for n in sizes:
        spans.append((0, total, n))
        total += (n + align - 1) // align * align
    return spans, total


@pytest.mark.parametrize("sizes,bucket_bytes", [
    ([37 * 101, 101, 101, 101 * 13, 13], 1000),
    ([5], 1), ([5, 7, 9], 10**9), ([3000, 1, 1, 1, 4000, 17], 2 * 3000),
    ([1] * 50, 64), ([12345, 999, 31, 7, 77777, 5], 40000),
])
def test_plan_tiles_each_buffer_in_backward_order(sizes, bucket_bytes):
    spans, total = _layout(sizes)
    other, total2 = _layout([11, 300, 2])  # a second buffer (another dtype)
    spans += [(1, off, n) for _, off, n in other]
    flats = [torch.zeros(total, dtype=torch.float16), torch.zeros(total2, dtype=torch.float32)]
    plan = grad_buckets.GradBuckets(flats, spans, bucket_bytes)
    for fi, flat in enumerate(flats):
        mine = [(lo, hi) for f, lo, hi in plan.buckets if f == fi]
        # issue order runs from the end of the buffer to its start, without gaps or overlap
        assert mine[0][1] == flat.numel() and mine[-1][0] == 0
        assert all(a[0] == b[1] for a, b in zip(mine, mine[1:]))
        for lo, hi in mine[:-1]:  # every bucket but a buffer's first reaches the size
            assert (hi - lo) * flat.element_size() >= bucket_bytes
    assert [f for f, _, _ in plan.buckets] == sorted((f for f, _, _ in plan.buckets), reverse=True)
    for i, (fi, off, n) in enumerate(spans):
        f, lo, hi = plan.buckets[plan.bucket_of[i]]
        assert f == fi and lo <= off and off + n <= hi, (i, plan.buckets[plan.bucket_of[i]])
    assert sum(plan.sizes) == len(spans)
    assert plan.sizes == [plan.bucket_of.count(b) for b in range(len(plan.buckets))]


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 101), torch.nn.LayerNorm(101),
                               torch.nn.Linear(101, 13)).to(dtype)


def _worker(rank, dtype):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(100 + rank)
    ref = _model(dtype)
    grads = [torch.randn(p.shape, generator=g).to(dtype) for p in ref.parameters()]
    for p, gr in zip(ref.parameters(), grads):
        p.grad = gr.clone()
    LegacyDistributedDataParallel(ref, group).all_reduce_grads()

    model = _model(dtype)
    params = list(model.parameters())
    spans, total = _layout([p.numel() for p in params])
    flat_grads = FlatGradients(params)  # the engine's accumulators (the same layout)
    (flat,) = flat_grads.flats
    assert flat_grads.spans == spans and flat.numel() == total
    for p, gr, (_, off, n) in zip(params, grads, spans):
        p.grad = flat[off:off + n].view_as(p)
        p.grad.copy_(gr)
    # the engine's reducer, its buckets of 150 elements, NCCL's reduction (here gloo's)
    reducer = GradientReducer(flat_grads, bucket_mb=150 * flat.element_size() / 2**20,
                              reduce_bucket=grad_buckets.legacy_reduce(WORLD, group))
    exchange.register(model, reducer)
    reducer.expect(None, None)  # the update's last micro-batch
    reducer.issue()  # the end of its backward
    plan = reducer.buckets
    out = {"buckets": len(plan.buckets)}
    out["equal"] = all(torch.equal(p.grad, q.grad) for p, q in zip(params, ref.parameters()))
    # the optimizer's all_reduce_grads takes the exchange and reduces nothing more
    wrapped = ModuleProxyWrapper(LegacyDistributedDataParallel(model, group))
    opt = FairseqLSAdam(LSAdamConfig(lr=[1e-3]), params)
    opt.all_reduce_grads(wrapped)
    out["not_reduced_twice"] = all(torch.equal(p.grad, q.grad)
                                   for p, q in zip(params, ref.parameters()))
    out["mark_taken_off"] = not exchange_of(wrapped).reduced
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bucketed_reduce_is_fairseq_legacy_all_reduce(tmp_path, dtype):
    for rank, r in enumerate(run_workers(tmp_path, _worker, dtype, world=WORLD)):
        assert r["buckets"] >= 3  # the case is bucketed, not one buffer
        assert r["equal"], f"rank {rank}: bucketed all-reduce differs from fairseq's"
        assert r["not_reduced_twice"] and r["mark_taken_off"]


def test_partly_marked_buffers_are_an_error():
    """Two flat buffers of which one was reduced during the backward: never a silent skip or a
    second reduction of the other."""
    from ls_fairseq.distributed import flat_all_reduce

    class FakeLegacy(LegacyDistributedDataParallel):
        def __init__(self, module):
            torch.nn.Module.__init__(self)
            self.module, self.world_size, self.accumulate_grads = module, 2, False

    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2).double())
    flat_grads = FlatGradients(model[0].parameters())  # the engine's, of the float32 gradients
    flats = [flat_grads.flats[0], torch.zeros(32, dtype=torch.float64)]
    offsets = {torch.float32: 0, torch.float64: 0}
    for p in model.parameters():
        flat = flats[0] if p.dtype == torch.float32 else flats[1]
        off = offsets[p.dtype]
        p.grad = flat[off:off + p.numel()].view_as(p)
        offsets[p.dtype] = off + (p.numel() + 15) // 16 * 16
    # reduced: the float32 buffer, the engine's; the float64 one is not the engine's
    reduced = GradientExchange(flat_grads, REDUCED)
    with pytest.raises(RuntimeError, match="all-reduced during the backward and others not"):
        flat_all_reduce.all_reduce_flat(FakeLegacy(model), reduced)
