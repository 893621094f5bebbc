"""The gradient all-reduce by copy engines: GPUs of one host write into each other's memory.

NCCL's all-reduce runs as kernels that hold SMs for as long as the data takes to cross NVLink;
during the backward those SMs are missing from the backward's own kernels (``docs/PERFORMANCE.md``,
"Several GPUs"). Here the GPUs' copy engines move the data, and the only kernel is one sum per
shard (``ops.shard_reduce``). Used by the engine's ``reducer.GradientReducer`` (which chooses it
over NCCL) for each gradient bucket of ``grad_buckets.GradBuckets``, on the same side stream and at
the same points as the NCCL buckets it replaces. Where each shard lives: ``shard_plan.ShardPlan``.

Each bucket (a span of a flat gradient buffer) is cut into ``world`` shards, shard ``k`` owned by
rank ``k``. For bucket ``b``, on every rank ``r``, in stream order:

1. **push**: rank ``r``'s copy of shard ``k`` goes into rank ``k``'s staging buffer, for every
   ``k != r`` (a copy into peer memory: a copy engine carries it);
2. **barrier**: a one-element NCCL all-reduce (or, with ``LS_FAIRSEQ_PEER_BARRIER=flags``,
   ``ops.peer_barrier``'s kernel: flags written into the other ranks' memory, one host launch
   instead of a collective and its wait); when it completes, every rank's pushes of bucket ``b``
   have landed;
3. **reduce**: shard ``r`` becomes (own + the ``world - 1`` staged copies, in rank order) /
   world, accumulated in float32 and rounded once (``ops.shard_reduce``);
4. **push the result**: shard ``r`` goes into every other rank's flat buffer, in place (not
   with ``scatter_only``: the sharded optimizer step, ``sharded_step.py``, sends the updated
   weights of the shard instead, after Adam).

After the last bucket one more barrier says every result has landed; the step's current stream
waits for it (not with ``scatter_only``: nothing lands). Each shard is reduced by one rank only,
so every rank ends with the same bits.
Staging holds, on rank ``r``, ``world - 1`` copies of its shards: (world - 1) / world of the
gradients' size (210 MB for transformer big's fp16 gradients on 2 GPUs).

The buffers are exchanged once, as CUDA IPC handles (``ops.peer_memory``), when the first update
is all-reduced. Every rank then takes this path or none does (the decision is collective), as NCCL
pairs the ranks' collectives by their order. It applies where every rank of the data-parallel
group is a process of this host whose GPU this process can reach by peer access, with the
extension built, NCCL, and 2 to 16 ranks; elsewhere NCCL's all-reduce runs, with one log line
(``--ls-copy-engine-all-reduce`` refuses the run instead, ``--ls-no-copy-engine-all-reduce``
keeps NCCL).
"""
import socket

import torch
import torch.distributed as dist

from .. import switches
from ..ops import _extension, peer_barrier, peer_memory
from ..ops.shard_reduce import shard_reduce_
from .collective_setup import attempt, everyone, first_line, first_reason, nbytes
from .shard_plan import ShardPlan

FLAG = "--ls-copy-engine-all-reduce"
#: the barrier between the phases: "nccl" (a one-element all-reduce, the default) or "flags"
#: (ops.peer_barrier: one kernel, one host launch); its values: ops/_extension.py's ENV_VARS
BARRIER_ENV = "LS_FAIRSEQ_PEER_BARRIER"
#: most GPUs: the shard sum kernel takes 15 received shards (csrc/shard_reduce.cu, kMaxParts)
MAX_WORLD = 16


class PeerAllReduce:
    """The copy-engine all-reduce of one rank (see the module doc).

    ``flats``: this rank's flat gradient buffers; ``staging``: its staging buffers (one per flat,
    ``plan.staging_numel``); ``peer_flats[q]`` / ``peer_staging[q]``: rank ``q``'s buffers as this
    process reaches them (peer memory on the GPU; the tensors themselves in the tests, which drive
    several ranks in one process phase by phase). ``barrier()``: returns a work handle the current
    stream can wait on, or None. ``group``: the ranks' process group.
    """

    def __init__(self, plan, rank, flats, staging, peer_flats, peer_staging, barrier=None,
                 group=None):
        self.plan, self.rank, self.group = plan, rank, group
        self.flats, self.staging = flats, staging
        self.peer_flats, self.peer_staging = peer_flats, peer_staging
        self.barrier = barrier
        # phases 1-3 only: each rank keeps its own summed shards (the sharded step follows:
        # scatter_only_from_next_update)
        self.scatter_only = False
        # GradBuckets.issue hands over each bucket as the view flats[f][lo:hi]: found by address
        self._bucket_of = {(flats[f][lo:hi].data_ptr(), hi - lo): b
                           for b, (f, lo, hi) in enumerate(plan.buckets)}
        self._views = {}  # bucket -> its _BucketViews, made at its first use

    def scatter_only_from_next_update(self):
        """From the next bucket on, phases 1-3 only (no phase 4, no final barrier): each rank
        keeps its own summed shards, for the sharded optimizer step (``sharded_step.py``; ls_adam
        calls this once every rank has agreed to take it, after this update's all-reduce)."""
        self.scatter_only = True

    # -- the four phases of one bucket ---------------------------------------------------------

    def push(self, b: int):
        for dst, src in self._bucket_views(b).pushes:
            dst.copy_(src, non_blocking=True)

    def reduce(self, b: int):
        views = self._bucket_views(b)
        if views.shard is not None:
            shard_reduce_(views.shard, views.parts, 1.0 / self.plan.world)

    def push_result(self, b: int):
        for dst, src in self._bucket_views(b).results:
            dst.copy_(src, non_blocking=True)

    def _bucket_views(self, b: int):
        """Every tensor view the phases of bucket ``b`` touch, made once: the buffers live as long
        as this object, and on 4 GPUs the host's time to queue an update is part of its wall time
        (docs/PERFORMANCE.md, "Several GPUs"), so each phase only queues its copies or its
        kernel."""
        views = self._views.get(b)
        if views is None:
            views = self._views[b] = _BucketViews(self, b)
        return views

    # -- GradBuckets.issue's reduce function ---------------------------------------------------

    def bucket_index(self, bucket) -> int:
        """The plan's index of ``bucket``, a view ``flats[f][lo:hi]``."""
        b = self._bucket_of.get((bucket.data_ptr(), bucket.numel()))
        if b is None:
            raise ValueError("ls_fairseq: a gradient bucket outside the flat buffers; please "
                             "report this")
        return b

    def __call__(self, bucket):
        """Issues the all-reduce of ``bucket`` on the current (side) stream; no work to wait for
        (the barrier of :meth:`finish` covers it)."""
        b = self.bucket_index(bucket)
        self.push(b)
        self._wait(self.barrier())
        self.reduce(b)
        if not self.scatter_only:
            self.push_result(b)
        return None

    def finish(self):
        """After the last bucket: the barrier whose completion means every result has landed
        (none with ``scatter_only``)."""
        return None if self.scatter_only else self.barrier()

    @staticmethod
    def _wait(work):
        if work is not None:
            work.wait()  # NCCL: the current stream waits, not the host


class _BucketViews:
    """Bucket ``b``'s views on one rank: ``pushes`` and ``results``, ``(destination, source)``
    copies (its shard of every other rank into that rank's staging; its own reduced shard into
    every other rank's flat buffer); ``shard``, its own shard (None when empty), and ``parts``,
    the staged copies the other ranks pushed, in rank order."""

    __slots__ = ("pushes", "shard", "parts", "results")

    def __init__(self, ar, b):
        plan, rank = ar.plan, ar.rank
        f = plan.buckets[b][0]
        self.pushes = []
        for q, staging in ar.peer_staging.items():
            lo, hi = plan.shards[b][q]
            if hi > lo:
                start, end = plan.staged(rank, q, b)
                self.pushes.append((staging[f][start:end], ar.flats[f][lo:hi]))
        lo, hi = plan.shards[b][rank]
        self.shard, self.parts, self.results = None, [], []
        if hi > lo:
            self.shard = ar.flats[f][lo:hi]
            for q in range(plan.world):
                if q != rank:
                    start, end = plan.staged(q, rank, b)
                    self.parts.append(ar.staging[f][start:end])
            self.results = [(flats[f][lo:hi], self.shard) for flats in ar.peer_flats.values()]


def run_conflict(run: switches.RunFacts) -> str:
    """Why the copy-engine all-reduce cannot apply to ``run``, from what is known before training
    (empty: it may; the rest is decided with every rank at the first update, ``create``)."""
    if not run.cuda:
        return "it moves the gradients between GPUs, and this run trains on the CPU"
    if run.workers != run.processes:
        return (f"it needs plain data parallelism; this run has {run.workers} data-parallel "
                f"workers of {run.processes} (model parallelism)")
    if not 2 <= run.workers <= MAX_WORLD:
        return f"it takes 2 to {MAX_WORLD} GPUs, and this run has {run.workers}"
    if run.backend != "nccl":
        return f"it needs the NCCL backend, and this run uses {run.backend}"
    return ""


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _on_cuda(flats) -> bool:
    return all(f.is_cuda for f in flats)


def _local_check(flats, group):
    """Why this rank cannot take the copy-engine path (empty: it can), before any exchange;
    for gradients on a CUDA device (``create`` checks that first)."""
    world = dist.get_world_size(group)
    if dist.get_backend(group) != "nccl":
        return f"it needs the NCCL backend, this run uses {dist.get_backend(group)}"
    if not 2 <= world <= MAX_WORLD:
        return f"it takes 2 to {MAX_WORLD} GPUs, this run has {world}"
    if any(f.dtype not in (torch.float16, torch.bfloat16, torch.float32) for f in flats):
        return "the gradients are not float16, bfloat16 or float32"
    if not peer_memory.available(flats[0]):
        return "the ls_fairseq CUDA extension is not available"
    return ""


def _visible_peers(infos, rank, device):
    """Local device index of every other rank's GPU, or the reason one cannot be reached."""
    by_uuid = {str(torch.cuda.get_device_properties(d).uuid): d
               for d in range(torch.cuda.device_count())}
    devices = {}
    for q, info in enumerate(infos):
        if q == rank:
            continue
        if info["host"] != infos[rank]["host"]:
            return None, "the ranks are not all on one host"
        d = by_uuid.get(info["uuid"])
        if d is None:
            return None, f"rank {q}'s GPU is not visible to rank {rank} (CUDA_VISIBLE_DEVICES)"
        if d == device:
            return None, f"ranks {rank} and {q} share one GPU"
        if not torch.cuda.can_device_access_peer(device, d):
            return None, f"rank {rank}'s GPU cannot reach rank {q}'s by peer access"
        devices[q] = d
    return devices, ""


def create(flats, buckets, group):
    """``(PeerAllReduce, "")`` when every rank of ``group`` can take the copy-engine path, else
    ``(None, reason)``; the same answer on every rank. Collective: every rank calls it at the
    same point (the engine: at the first update it all-reduces). A rank's local failure becomes
    its reason, never an exception between two collectives (the other ranks would wait in the
    next one for good)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not _on_cuda(flats):
        # CPU ranks (gloo): the same on every rank, no exchange needed
        return None, "the gradients are not on a CUDA device"
    device = flats[0].device.index
    flag_barrier = _extension.env_value(BARRIER_ENV) == "flags"

    # 1. each rank's own conditions, its host and its GPU
    info, failed = attempt(lambda: {
        "reason": _local_check(flats, group) or _barrier_check(flag_barrier, flats[0]),
        "host": _host_id(), "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "flags": flag_barrier})
    infos = everyone(info or {"reason": failed}, group, world)
    reason = first_reason(infos)
    if not reason and len({i.get("flags", flag_barrier) for i in infos}) > 1:
        reason = f"the ranks do not all set {BARRIER_ENV} alike"  # their barriers would not pair
    # 2. every other rank's GPU reachable from this one
    if not reason:
        found, failed = attempt(lambda: _visible_peers(infos, rank, device))
        reason = failed or found[1]
    reason = first_reason(everyone({"reason": reason}, group, world))
    if reason:
        return None, reason
    # 3. staging buffers, and the IPC handles of every buffer
    plan = ShardPlan(buckets, [f.numel() for f in flats], world)

    # the flag barrier's flags (one int64 per rank) travel with the buffers
    signals = [torch.zeros(world, dtype=torch.int64, device=flats[0].device)] if flag_barrier \
        else []

    def share():
        staging = [torch.zeros(max(plan.staging_numel(rank, f), 1), dtype=flat.dtype,
                               device=flat.device) for f, flat in enumerate(flats)]
        try:
            return staging, [peer_memory.export(t) for t in list(flats) + staging + signals], ""
        except RuntimeError as exc:  # e.g. expandable segments: no IPC handles
            return None, None, (f"its buffers cannot be shared between processes "
                                f"({first_line(exc)})")

    shared, failed = attempt(share)
    staging, exported, reason = shared or (None, None, failed)
    gathered = everyone({"reason": reason, "exported": exported}, group, world)
    reason = first_reason(gathered)
    if reason:
        return None, reason

    # 4. every other rank's buffers opened in this process
    def open_peers():
        peer_flats, peer_staging, peer_signals = {}, {}, {}
        nf = len(flats)
        for q in range(world):
            if q == rank:
                continue
            views = peer_memory.open_segments(gathered[q]["exported"], device)
            sizes = ([f.numel() for f in flats] + [plan.staging_numel(q, f) for f in range(nf)]
                     + [world] * len(signals))
            typed = [v[:nbytes(t, n)].view(t.dtype)
                     for v, t, n in zip(views, list(flats) + staging + signals, sizes)]
            peer_flats[q], peer_staging[q] = typed[:nf], typed[nf:2 * nf]
            peer_signals[q] = typed[2 * nf:]
        return peer_flats, peer_staging, peer_signals

    peers, failed = attempt(open_peers, "opening another rank's memory failed")
    reason = first_reason(everyone({"reason": failed}, group, world))
    if reason:
        return None, reason
    if flag_barrier:
        barrier = FlagBarrier(signals[0], [peers[2][q][0] for q in sorted(peers[2])], rank)
    else:
        flag = torch.zeros(1, device=flats[0].device)

        def barrier():
            return dist.all_reduce(flag, group=group, async_op=True)

    return PeerAllReduce(plan, rank, list(flats), staging, peers[0], peers[1], barrier,
                         group), ""


class FlagBarrier:
    """The barrier by flags in peer memory (``ops.peer_barrier``, ``LS_FAIRSEQ_PEER_BARRIER=flags``):
    each call queues the next numbered barrier on the current stream; nothing to wait for after
    it (the kernel itself holds the stream until every rank has arrived). Every rank calls it the
    same number of times, in the same order, as it would NCCL's."""

    def __init__(self, flags, peer_flags, rank):
        self.flags, self.peer_flags, self.rank = flags, list(peer_flags), rank
        self.epoch = 0  # this rank's barriers so far
        self._launch = peer_barrier.bind(flags, self.peer_flags, rank)  # checked once, here

    def __call__(self):
        self.epoch += 1
        self._launch(self.epoch)
        return None


def _barrier_check(flag_barrier, t) -> str:
    """Why this rank cannot take the barrier LS_FAIRSEQ_PEER_BARRIER asks for (empty: it can)."""
    if flag_barrier and not peer_barrier.available(t):
        return f"{BARRIER_ENV}=flags needs the ls_fairseq CUDA extension's peer_barrier_"
    return ""
