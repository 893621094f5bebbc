"""ls_adam's gradient all-reduce under fairseq's legacy_ddp
(ls_fairseq/distributed/flat_all_reduce.py) against fairseq's own
LegacyDistributedDataParallel.all_reduce_grads: two CPU processes (gloo), different random
gradients per rank, odd parameter sizes. The flat path must give bitwise the
same gradients (same dtype, same division, a two-rank sum is order-free), and must hand over to
fairseq's method whenever the gradients are not exactly a set of flat buffers."""
import pytest
import torch
import torch.distributed as dist
from fairseq.distributed import LegacyDistributedDataParallel, ModuleProxyWrapper

from fairseq_helpers import run_workers

from ls_fairseq.distributed import flat_all_reduce
from ls_fairseq.wrappers import data_parallel_of, grad_sync_due, is_torch_ddp, world_size
from ls_fairseq.optim.ls_adam import FairseqLSAdam, LSAdamConfig

WORLD = 2


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 101), torch.nn.LayerNorm(101),
                               torch.nn.Linear(101, 13)).to(dtype)


def _grads(model, rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()]


def _flat_views(model, grads, align=16, extra_gap=0):
    """The grads copied into one flat buffer, each view aligned to ``align`` elements (as the
    CUDA-graph accumulators are), set as the parameters' .grad."""
    params = list(model.parameters())
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += (p.numel() + align - 1) // align * align + extra_gap
    flat = torch.zeros(total, dtype=params[0].dtype)
    for p, g, off in zip(params, grads, offsets):
        p.grad = flat[off:off + p.numel()].view_as(p)
        p.grad.copy_(g)
    return flat


def _worker(rank, dtype):
    group = dist.group.WORLD
    out = {}
    # fairseq's method, plain .grad tensors
    ref = _model(dtype)
    for p, g in zip(ref.parameters(), _grads(ref, rank)):
        p.grad = g.clone()
    LegacyDistributedDataParallel(ref, group).all_reduce_grads()
    # the flat path, reached the way the trainer reaches it: FP16Optimizer -> ls_adam ->
    # all_reduce_grads(trainer.model), trainer.model = ModuleProxyWrapper(legacy DDP)
    model = _model(dtype)
    _flat_views(model, _grads(model, rank))
    wrapped = ModuleProxyWrapper(LegacyDistributedDataParallel(model, group))
    opt = FairseqLSAdam(LSAdamConfig(lr=[1e-3]), [p for p in model.parameters()])
    opt.all_reduce_grads(wrapped)
    out["flat_equal"] = all(torch.equal(p.grad, q.grad)
                            for p, q in zip(model.parameters(), ref.parameters()))
    out["ddp_buffer_untouched"] = wrapped.module.buffer is None  # no 420 MB staging copy
    # not flat (plain tensors): fairseq's method runs, same result
    plain = _model(dtype)
    for p, g in zip(plain.parameters(), _grads(plain, rank)):
        p.grad = g.clone()
    w = ModuleProxyWrapper(LegacyDistributedDataParallel(plain, group))
    out["plain_took_flat"] = flat_all_reduce.all_reduce_flat(w, None)
    opt.all_reduce_grads(w)
    out["plain_equal"] = all(torch.equal(p.grad, q.grad)
                             for p, q in zip(plain.parameters(), ref.parameters()))
    # inside no_sync() (update-freq accumulation) nothing is reduced
    acc = _model(dtype)
    local = _grads(acc, rank)
    _flat_views(acc, local)
    ddp = LegacyDistributedDataParallel(acc, group)
    with ddp.no_sync():
        out["no_sync_took_flat"] = flat_all_reduce.all_reduce_flat(ModuleProxyWrapper(ddp),
                                                                   None)
    out["no_sync_untouched"] = all(torch.equal(p.grad, g) for p, g in zip(acc.parameters(), local))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flat_all_reduce_matches_fairseq_legacy_ddp(tmp_path, dtype):
    for rank, r in enumerate(run_workers(tmp_path, _worker, dtype, world=WORLD)):
        assert r["flat_equal"], f"rank {rank}: flat all-reduce differs from fairseq's"
        assert r["ddp_buffer_untouched"]
        assert not r["plain_took_flat"] and r["plain_equal"]
        assert r["no_sync_took_flat"] and r["no_sync_untouched"]


def test_flat_grad_buffers_accepts_only_exact_flat_views():
    model = _model(torch.float32)
    params = list(model.parameters())
    grads = _grads(model, 0)
    flat = _flat_views(model, grads)
    bufs = flat_all_reduce.flat_grad_buffers(params)
    assert len(bufs) == 1 and bufs[0] is flat
    # a gap wider than alignment padding could hold data that is not a gradient
    _flat_views(model, grads, extra_gap=16)
    assert flat_all_reduce.flat_grad_buffers(params) is None
    # a missing gradient (fairseq's method fills zeros), plain tensors, overlapping views
    _flat_views(model, grads)
    params[1].grad = None
    assert flat_all_reduce.flat_grad_buffers(params) is None
    for p, g in zip(params, grads):
        p.grad = g.clone()
    assert flat_all_reduce.flat_grad_buffers(params) is None
    base = torch.zeros(sum(p.numel() for p in params))
    for p in params:
        p.grad = base[:p.numel()].view_as(p)
    assert flat_all_reduce.flat_grad_buffers(params) is None
    # an expert parameter (MoE) is not all-reduced by fairseq: not ours to reduce either
    _flat_views(model, grads)
    params[0].expert = True
    assert flat_all_reduce.flat_grad_buffers(params) is None


def test_not_legacy_ddp_is_left_to_fairseq():
    model = _model(torch.float32)
    _flat_views(model, _grads(model, 0))
    assert data_parallel_of(model) is None
    assert not flat_all_reduce.all_reduce_flat(model, None)
    assert not flat_all_reduce.all_reduce_flat(ModuleProxyWrapper(_Holder(model)), None)


class _Holder(torch.nn.Module):  # a wrapper of the kind ModuleProxyWrapper takes (not DDP)
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_torch_ddp_is_found_through_the_proxy_and_left_to_itself_without_an_engine(tmp_path):
    """data_parallel_of (ls_fairseq/wrappers.py) finds either wrapper through fairseq's proxy.
    Under torch DDP the flat all-reduce leaves the gradients to DDP's hooks unless the CUDA-graph
    engine keeps them (its update's GradientExchange): then the engine has already all-reduced
    them at the end of the backward, and this only checks it did."""
    from ls_fairseq.distributed import NOTHING, REDUCED, GradientExchange
    from ls_fairseq.graphs import FlatGradients

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0,
                            world_size=1)
    try:
        model = _model(torch.float32)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        wrapped = ModuleProxyWrapper(ddp)
        assert data_parallel_of(wrapped) is ddp and is_torch_ddp(ddp)
        assert grad_sync_due(ddp) and world_size(ddp) == 1
        with ddp.no_sync():
            assert not grad_sync_due(ddp)
        _flat_views(model, _grads(model, 0))
        assert not flat_all_reduce.all_reduce_flat(wrapped, None)  # no engine: DDP's hooks did
        grads = FlatGradients(p for p in model.parameters() if p.requires_grad)
        with pytest.raises(RuntimeError, match="did not all-reduce them"):
            flat_all_reduce.all_reduce_flat(wrapped, GradientExchange(grads, NOTHING))
        with ddp.no_sync():  # an update's earlier micro-batches: nothing due
            assert flat_all_reduce.all_reduce_flat(wrapped, GradientExchange(grads, NOTHING))
        assert flat_all_reduce.all_reduce_flat(wrapped, GradientExchange(grads, REDUCED))
        legacy = LegacyDistributedDataParallel(model, dist.group.WORLD)
        assert data_parallel_of(ModuleProxyWrapper(legacy)) is legacy
        assert not is_torch_ddp(legacy) and grad_sync_due(legacy) and world_size(legacy) == 1
        with legacy.no_sync():
            assert not grad_sync_due(legacy)
    finally:
        dist.destroy_process_group()
