"""The copy-engine all-reduce (graphs/peer_all_reduce.py) on two GPUs: CUDA IPC, copies into peer
memory, NCCL barriers, against NCCL's bucketed legacy all-reduce of the same buffers
(grad_buckets.legacy_reduce, fairseq's sum of gradient / world size).

On 2 ranks both are one rounding of (a + b) / 2 per element (tests/test_shard_reduce.py), so the
results must be equal bit for bit, on both ranks, on the first update and on the next (the staging
buffers are reused). The copies must be peer-to-peer (profiled: "Memcpy PtoP"), not staged through
the host.
"""
import pytest
import torch

from fairseq_helpers import run_workers  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _grads(flats, spans, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for f, off, n in spans:
        sign = torch.randint(0, 2, (n,), device="cuda", generator=g) * 2 - 1
        flats[f][off:off + n].copy_(sign * torch.exp(torch.rand(n, device="cuda", generator=g)
                                                     * 6 - 3))


def _worker(rank):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ls_fairseq.graphs import peer_all_reduce
    from ls_fairseq.graphs.flat_gradients import FlatGradients
    from ls_fairseq.graphs.grad_buckets import GradBuckets, legacy_reduce

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s, device="cuda", dtype=torch.float16))
              for s in [(1000, 37), (1,), (4099,), (512, 512), (3,)]]
    params.append(torch.nn.Parameter(torch.zeros(77, device="cuda")))  # a float32 buffer too
    grads = FlatGradients(params)
    buckets = GradBuckets(grads.flats, grads.spans, 100_000)
    peer, reason = peer_all_reduce.create(grads.flats, buckets.buckets, dist.group.WORLD)
    out = {"reason": reason, "buckets": len(buckets.buckets)}
    if peer is None:
        return out
    nccl = GradBuckets(grads.flats, grads.spans, 100_000)
    for update in range(2):
        _grads(grads.flats, grads.spans, seed=10 * update + rank)
        inputs = [f.clone() for f in grads.flats]
        if update == 1:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                buckets.issue(grads.flats, [None] * len(buckets.buckets), peer)
                torch.cuda.synchronize()
            out["copies"] = sorted({e.key for e in prof.key_averages()
                                    if e.key.startswith("Memcpy")})  # device copies only
        else:
            buckets.issue(grads.flats, [None] * len(buckets.buckets), peer)
        ours = [f.clone() for f in grads.flats]
        for f, x in zip(grads.flats, inputs):
            f.copy_(x)
        nccl.issue(grads.flats, [None] * len(buckets.buckets), legacy_reduce(2, dist.group.WORLD))
        torch.cuda.synchronize()
        out[f"equal_{update}"] = all(torch.equal(a, b) for a, b in zip(ours, grads.flats))
        out[f"bytes_{update}"] = [a.cpu() for a in ours]
    return out


def test_copy_engine_all_reduce_equals_nccl_legacy(tmp_path):
    results = run_workers(tmp_path, _worker, backend="nccl")
    for r in results:
        assert r["reason"] == "" and r["buckets"] > 2
        assert r["equal_0"] and r["equal_1"]
        assert r["copies"] and all("PtoP" in c for c in r["copies"]), r["copies"]
    for update in range(2):
        for a, b in zip(results[0][f"bytes_{update}"], results[1][f"bytes_{update}"]):
            assert torch.equal(a, b)
