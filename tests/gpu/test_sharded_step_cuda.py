"""The sharded optimizer step (distributed/sharded_step.py) on every GPU of the machine (2 or more):
CUDA IPC of the weights' flat buffers, the copy-engine reduce-scatter, NCCL's one-element and
consolidating all-reduces, ls_adam's CUDA kernel on the pieces of each rank's shards, the weight
pushes. The reference runs in the same processes on the same gradients: the same optimizer with
--ls-no-sharded-optimizer-step (the whole all-reduce, the whole Adam step on every rank).

Tolerances, no clipping (the clip factor would carry the grad norm's other summation order):
* every rank holds the same weights, bit for bit (each element is stepped by one rank, copied);
* the grad norms: relative 1e-6 (summed per shard, then over the ranks);
* weights, fp32 master and moments against the whole step: the kernel's vector and scalar paths
  (pieces start at other alignments than whole tensors) may contract the same formula into
  different FMAs: master and moments relative 1e-6, weights one fp16 ulp. The CPU test
  (tests/test_sharded_step.py) holds the same protocol to bit equality.
* one update overflows (an inf on rank 1): no rank steps it.
"""
import pytest
import torch

from fairseq_helpers import run_workers  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

SHAPES = [(1000, 37), (1,), (4099,), (512, 512), (3,), (5, 7)]
UPDATES, OVERFLOW_AT = 5, 3


def _model(flags):
    import types

    import torch.distributed as dist
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    from fairseq_helpers import fp16_optimizer_cfg
    from ls_fairseq.distributed import GradientReducer, peer_all_reduce
    from ls_fairseq.distributed.exchange import register
    from ls_fairseq.graphs.flat_gradients import FlatGradients

    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, device="cuda", generator=g) * 0.1).half())
              for s in SHAPES]
    m = types.SimpleNamespace(params=params, module=torch.nn.ParameterList(params))
    m.grads = FlatGradients(params)
    m.reducer = GradientReducer(m.grads, bucket_mb=100_000 / 2**20)  # the engine's, 100 kB buckets
    register(m.module, m.reducer)
    m.buckets = m.reducer.buckets
    m.peer, m.reason = peer_all_reduce.create(m.grads.flats, m.buckets.buckets, dist.group.WORLD)
    if m.peer is not None:
        m.reducer.use_copy_engines(m.peer)  # what the engine does once it chose copy engines
    m.opt = FP16Optimizer.build_optimizer(fp16_optimizer_cfg("ls_adam", flags), params)
    return m


def _update(m, rank, update):
    """fairseq's trainer and the engine around one update; returns the grad norm or None."""
    m.opt.zero_grad()
    m.grads.bind(True)
    g = torch.Generator(device="cuda").manual_seed(10 * update + rank)
    for p in m.params:
        p.grad.copy_(torch.randn(p.shape, device="cuda", generator=g) * 0.05)
    if update == OVERFLOW_AT and rank == 1:
        m.params[2].grad.view(-1)[7] = float("inf")
    m.reducer.expect(None, None)  # the engine's all-reduce at the end of the backward
    m.reducer.issue()
    m.opt.all_reduce_grads(m.module)
    try:
        norm = m.opt.clip_grad_norm(0.0)
    except OverflowError:
        return None
    m.opt.step()
    return float(getattr(norm, "plain", lambda: norm)())


def _worker(rank):
    from ls_fairseq.distributed.sharded_step import ShardedStep

    ours = _model([])
    ref = _model(["--ls-no-sharded-optimizer-step"])
    out = {"reason": ours.reason}
    if ours.peer is None:
        return out
    out["norms"] = [(_update(ours, rank, u), _update(ref, rank, u)) for u in range(UPDATES)]
    out["sharded"] = isinstance(ours.opt.sharding, ShardedStep) and ours.peer.scatter_only
    out["whole"] = ref.opt.sharding is False and not ref.peer.scatter_only
    ours.opt.optimizer.consolidate_state_dict()  # fairseq's trainer, before a checkpoint
    torch.cuda.synchronize()
    state, want = ours.opt.state_dict(), ref.opt.state_dict()
    (s,), (w,) = state["state"].values(), want["state"].values()
    out["steps"] = (s["step"], w["step"])
    out["weights"] = torch.cat([p.detach().view(-1) for p in ours.params]).cpu()
    out["ref_weights"] = torch.cat([p.detach().view(-1) for p in ref.params]).cpu()
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = (s[key].cpu(), w[key].cpu())
    out["master"] = (ours.opt.master.detach().cpu(), ref.opt.master.detach().cpu())
    return out


def test_sharded_step_on_every_gpu(tmp_path):
    results = run_workers(tmp_path, _worker, world=torch.cuda.device_count(), backend="nccl")
    for r in results:
        assert r["reason"] == ""
        assert r["sharded"] and r["whole"]
        assert r["steps"] == (UPDATES - 1, UPDATES - 1)
        for u, (got, want) in enumerate(r["norms"]):
            if u == OVERFLOW_AT:
                assert got is None or not torch.isfinite(torch.tensor(got))
            else:
                assert got == pytest.approx(want, rel=1e-6)
        assert torch.equal(r["weights"], results[0]["weights"])
        torch.testing.assert_close(r["weights"].float(), r["ref_weights"].float(), rtol=2**-10,
                                   atol=0)
        for key in ("exp_avg", "exp_avg_sq", "master"):
            torch.testing.assert_close(*r[key], rtol=1e-6, atol=1e-12)
        print(f"differing from the whole step: weights "
              f"{int(r['weights'].ne(r['ref_weights']).sum())}, master "
              f"{int(r['master'][0].ne(r['master'][1]).sum())} of {r['master'][0].numel()}")
