"""The sharded optimizer step: on GPUs of one host, each rank runs Adam only on the gradient
shards it sums, then sends its updated fp16 weights to the other ranks.

Why: with the copy-engine all-reduce (``peer_all_reduce.py``) rank ``r`` already holds the summed
gradients of its shards (phase 3) before it pushes them to every other rank (phase 4), and then
every rank runs the same Adam over the whole model, a step already at its memory-bandwidth floor, so
only less work per rank makes it cheaper. Here phase 4 is dropped, each rank steps 1/N of the model,
and the updated fp16 weights of its shards travel instead: the same bytes as phase 4, moved after
Adam instead of under the backward (``docs/PERFORMANCE.md``, "Several GPUs").

How (``ls_adam``'s ``LSFusedFP16Optimizer`` drives it; ``--ls-sharded-optimizer-step``):

* At the first update (every rank, as it all-reduces): the model's fp16 parameters move into flat
  buffers laid out like the gradient buffers (``FlatGradients``: same offsets, so a gradient shard
  and its weights are the same span), and every rank opens the others' buffers (CUDA IPC, as the
  copy-engine all-reduce does). That update still runs the full all-reduce and a full Adam step;
  the engine drops phase 4 from the next update on (ls_adam calls
  ``PeerAllReduce.scatter_only_from_next_update``; each later update's ``GradientExchange`` then
  says ``scattered``).
* Each later update: the grad norm is the square root of the sum over ranks (a one-element
  all-reduce) of each rank's sum of squares over its shards; Adam (``ls_adam``) runs on the pieces
  of the fp32 master, its moments, the gradients and the fp16 weights inside this rank's shards
  (``adam_views``); then ``push_params`` copies the shards' new weights into every other rank's
  buffers and waits, on the stream, for a barrier: afterwards every rank has every weight.
* The other ranks' reduces of an update are done before this rank's pushes of the next overwrite
  their staging buffers: the grad-norm all-reduce needs every rank's shard sums, which each rank
  queues after its reduces.
* Outside this rank's shards the fp32 master and the moments go stale (``stale``). ``consolidate``
  (fairseq's ``consolidate_optimizer`` before a checkpoint, through ``LSAdam
  .consolidate_state_dict``) zeroes them there and sums them over the ranks (exact: one value and
  zeros), so every rank again holds the whole state and checkpoints are fairseq's, loadable on
  any number of GPUs.

Every rank takes this path or none does (``create`` is collective, like ``peer_all_reduce.create``).
"""
import torch
import torch.distributed as dist

from ..ops import peer_memory
from .collective_setup import attempt, everyone, first_reason, nbytes

FLAG = "--ls-sharded-optimizer-step"


class ShardedStep:
    """Rank ``peer.rank``'s part of the sharded step (see the module doc).

    ``peer``: the engine's ``PeerAllReduce`` (its shard plan and barrier); ``grads``: the
    model's ``FlatGradients``; ``param_flats``: this rank's fp16 weights, flat, laid out like
    ``grads.flats``; ``peer_param_flats[q]``: rank ``q``'s, as this process reaches them;
    ``all_reduce_sum(t)``: sums ``t`` over the ranks in place (a collective)."""

    def __init__(self, peer, grads, param_flats, peer_param_flats, all_reduce_sum):
        self.peer, self.grads = peer, grads
        self.param_flats = param_flats
        self.all_reduce_sum = all_reduce_sum
        plan, rank = peer.plan, peer.rank
        #: (flat index, lo, hi) of every non-empty shard this rank sums and steps
        self.owned = [(f, *plan.shards[b][rank]) for b, (f, _, _) in enumerate(plan.buckets)
                      if plan.shards[b][rank][1] > plan.shards[b][rank][0]]
        self.grad_shards = [grads.flats[f][lo:hi] for f, lo, hi in self.owned]
        self.pushes = [(flats[f][lo:hi], param_flats[f][lo:hi])
                       for flats in peer_param_flats.values() for f, lo, hi in self.owned]
        self._span_of = {id(p): span for p, span in zip(grads.params, grads.spans)}
        self.stale = False  # master and moments outside the owned shards are out of date
        self._views = None  # (key, views) of adam_views

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm (fp32) of the summed gradients: this rank's shards' sum of squares,
        summed over the ranks (collective; nothing is read back)."""
        if self.grad_shards:
            norms = torch._foreach_norm(self.grad_shards, 2, dtype=torch.float32)
            sq = torch.stack(norms).square().sum()
        else:
            sq = torch.zeros((), dtype=torch.float32, device=self.grads.flats[0].device)
        self.all_reduce_sum(sq)
        return sq.sqrt()

    def pieces(self, params):
        """``(i, start, end)`` per piece of ``params[i]`` (element range, in the parameter's own
        order) inside this rank's shards, in shard order."""
        where = self._span_of
        missing = [i for i, p in enumerate(params) if id(p) not in where]
        if missing:
            raise ValueError(f"{FLAG}: {len(missing)} optimized parameter(s) without a flat "
                             f"gradient")
        by_flat = {}
        for i, p in enumerate(params):
            f, off, n = where[id(p)]
            by_flat.setdefault(f, []).append((off, n, i))
        for spans in by_flat.values():
            spans.sort()
        out = []
        for f, lo, hi in self.owned:
            for off, n, i in by_flat.get(f, ()):
                a, e = max(lo, off), min(hi, off + n)
                if e > a:
                    out.append((i, a - off, e - off))
        return out

    def adam_views(self, params, master, exp_avg, exp_avg_sq):
        """``(masters, grads, exp_avgs, exp_avg_sqs, fp16 weights)``: views of the pieces of
        this rank's shards (``pieces``) in fairseq's flat fp32 ``master`` (the parameters'
        elements back to back, in ``params`` order), its moments, the flat gradients and the
        flat fp16 weights, for one multi-tensor Adam launch. Made once per set of buffers."""
        key = (tuple(id(p) for p in params), master.data_ptr(), exp_avg.data_ptr(),
               exp_avg_sq.data_ptr())
        if self._views is not None and self._views[0] == key:
            return self._views[1]
        starts, total = _master_starts(params)
        if total != master.numel():
            raise RuntimeError(f"{FLAG}: the flat fp32 master has {master.numel()} elements but "
                               f"the fp16 params have {total}")
        views = ([], [], [], [], [])
        for i, a, e in self.pieces(params):
            f, off, _ = self._span_of[id(params[i])]
            m = slice(starts[i] + a, starts[i] + e)
            views[0].append(master.data[m])
            views[1].append(self.grads.flats[f][off + a:off + e])
            views[2].append(exp_avg[m])
            views[3].append(exp_avg_sq[m])
            views[4].append(self.param_flats[f][off + a:off + e])
        self._views = (key, views)
        return views

    def push_params(self):
        """After this rank's Adam: its shards' new weights into every other rank's buffers, then
        the barrier after which every rank's pushes have landed (the current stream waits)."""
        for dst, src in self.pushes:
            dst.copy_(src, non_blocking=True)
        self.peer._wait(self.peer.barrier())
        self.stale = True

    def consolidate(self, params, tensors):
        """Every rank gets the whole of each of ``tensors`` (fp32 master or a moment, laid out
        as the master): zeroed outside this rank's shards, then summed over the ranks
        (collective)."""
        starts, total = _master_starts(params)
        gaps, end = [], 0
        for a, e in sorted((starts[i] + a, starts[i] + e) for i, a, e in self.pieces(params)):
            if a > end:
                gaps.append((end, a))
            end = max(end, e)
        if end < total:
            gaps.append((end, total))
        for t in tensors:
            if t.numel() != total:
                raise RuntimeError(f"{FLAG}: a state tensor of {t.numel()} elements, the "
                                   f"master has {total}")
            for a, e in gaps:
                t[a:e].zero_()
            self.all_reduce_sum(t)
        self.stale = False


def _master_starts(params):
    """Where each of ``params`` starts in fairseq's flat fp32 master (their elements back to
    back, in order), and the master's size."""
    starts, total = [], 0
    for p in params:
        starts.append(total)
        total += p.numel()
    return starts, total


def rehome(grads):
    """Moves every parameter of ``grads`` (``FlatGradients``) into flat buffers laid out like
    the gradient buffers (``p.data`` becomes a view; the parameter objects stay). Returns the
    buffers. Graphs captured before read the old storage; the engine re-captures
    (``graphs.replay.CudaGraphedLoss`` checks the parameters' storage before each step)."""
    flats = [torch.zeros_like(g) for g in grads.flats]
    for p, (f, off, n) in zip(grads.params, grads.spans):
        view = flats[f][off:off + n]
        view.copy_(p.data.reshape(-1))
        p.data = view.view_as(p)
    return flats


def create(grads, peer):
    """``(ShardedStep, "")`` when every rank can take the sharded step, else ``(None, reason)``;
    the same answer on every rank. ``peer``: the engine's ``PeerAllReduce`` (this rank's), or
    None where the gradients travel by NCCL (then on every rank: the engine decided with all of
    them). Collective over ``peer.group`` (every rank calls it at the same point: ls_adam, at
    the first update all-reduced during the backward)."""
    if peer is None:
        return None, ("it needs the copy-engine all-reduce (GPUs of one host with peer access; "
                      "--ls-copy-engine-all-reduce)")
    group, rank, world = peer.group, peer.rank, peer.plan.world
    device = grads.flats[0].device

    def share():
        flats = rehome(grads)
        return flats, [peer_memory.export(t) for t in flats]

    shared, failed = attempt(share, "sharing the weights' buffers failed")
    gathered = everyone({"reason": failed, "exported": shared and shared[1]}, group, world)
    reason = first_reason(gathered)
    if reason:  # the weights may have moved: harmless, they are the same values
        return None, reason
    param_flats = shared[0]

    def open_peers():
        out = {}
        for q in range(world):
            if q != rank:
                views = peer_memory.open_segments(gathered[q]["exported"], device.index)
                out[q] = [v[:nbytes(t, t.numel())].view(t.dtype)
                          for v, t in zip(views, param_flats)]
        return out

    peers, failed = attempt(open_peers, "opening another rank's weights failed")
    reason = first_reason(everyone({"reason": failed}, group, world))
    if reason:
        return None, reason

    def all_reduce_sum(t):
        dist.all_reduce(t, group=group)  # NCCL: queued on the stream, the host does not wait

    return ShardedStep(peer, grads, param_flats, peers, all_reduce_sum), ""
