"""Gradient all-reduce bucket by bucket, overlapped with the backward.

Used by ``--ls-cuda-graphs`` on several GPUs (every DDP backend of fairseq), where all
gradients live in flat per-dtype buffers (``graphs/flat_gradients.py``). Without overlap, each
buffer is divided and all-reduced once the backward is over (``flat_all_reduce.py``), and the
whole all-reduce adds to every update (docs/PERFORMANCE.md, "Several GPUs").

Here the buffers are cut into buckets of about ``bucket_bytes``, in reverse parameter order (the
order in which the backward completes them, as torch DDP does). A CUDA event marks the point where
a bucket's gradients are complete; inside a captured backward graph it is an external event node,
so every replay signals it. Once the backward is issued (the end of the autograd pass), the host
queues every bucket's division and all-reduce on a side stream, each behind its event: the GPU runs
them while the rest of the backward goes on. The engine's ``reducer.GradientReducer`` schedules
this and then hands ls_adam's ``all_reduce_grads`` a ``GradientExchange`` that says so
(``exchange.py``), so the optimizer does not reduce them again.

``reduce`` is fairseq's legacy reduction by NCCL (``legacy_reduce``) or, on GPUs of one host,
the copy-engine all-reduce (``peer_all_reduce.PeerAllReduce``), which has a ``finish`` step.

NCCL pairs the collectives of the ranks by their order, so every rank issues the same buckets in
the same order at the same point of the update (the end of the backward of its last micro-batch),
whether its step replayed a graph or ran eagerly. The result is fairseq's legacy all-reduce
(gradient / world size, summed over ranks) element by element: a bucket is a contiguous span of a
flat buffer, and the buckets tile each buffer exactly (alignment padding included; it is zero).
"""
import collections

import torch
import torch.distributed as dist


class GradBuckets:
    """The bucket plan of a set of flat gradient buffers.

    ``spans``: for each parameter, ``(index of its flat buffer, offset, numel)``. Bucket ``b``
    is ``flats[buckets[b][0]][buckets[b][1]:buckets[b][2]]``; ``bucket_of[i]`` is parameter
    ``i``'s bucket, ``sizes[b]`` the number of parameters in bucket ``b``.
    """

    def __init__(self, flats, spans, bucket_bytes):
        self.buckets, self.bucket_of = [], [None] * len(spans)
        for fi in reversed(range(len(flats))):
            members = sorted((off, i) for i, (f, off, _) in enumerate(spans) if f == fi)
            if not members:
                continue
            elem, hi, current = flats[fi].element_size(), flats[fi].numel(), []
            for k in reversed(range(len(members))):
                off, i = members[k]
                current.append(i)
                if k == 0 or (hi - off) * elem >= bucket_bytes:
                    lo = 0 if k == 0 else off  # the first bucket of a buffer starts at 0
                    for j in current:
                        self.bucket_of[j] = len(self.buckets)
                    self.buckets.append((fi, lo, hi))
                    hi, current = lo, []
        counts = collections.Counter(self.bucket_of)
        self.sizes = [counts[b] for b in range(len(self.buckets))]
        self._side = None

    def issue(self, flats, ready, reduce):
        """Queues ``reduce(bucket)`` for every bucket, in bucket order.

        ``ready[b]``: an event after which bucket ``b`` is complete, or None for "once the work
        queued so far on the current stream is done". ``reduce`` returns a ``torch.distributed``
        work handle (or None); the current stream waits for all of them (the host does not).
        A ``reduce`` with a ``finish()`` method (``peer_all_reduce.PeerAllReduce``) has it
        called after the last bucket, on the same stream; its work is waited for too.
        On CPU the buckets are reduced one after the other, now."""
        finish = getattr(reduce, "finish", None)
        if not flats[0].is_cuda:
            for fi, lo, hi in self.buckets:
                work = reduce(flats[fi][lo:hi])
                if work is not None:
                    work.wait()
            work = finish() if finish is not None else None
            if work is not None:
                work.wait()
            return
        current = torch.cuda.current_stream(flats[0].device)
        if self._side is None:
            self._side = torch.cuda.Stream(device=flats[0].device)
        now, works = None, []
        for (fi, lo, hi), event in zip(self.buckets, ready):
            if event is None:
                if now is None:
                    now = torch.cuda.Event()
                    now.record(current)
                event = now
            self._side.wait_event(event)
            with torch.cuda.stream(self._side):
                works.append(reduce(flats[fi][lo:hi]))
        if finish is not None:
            with torch.cuda.stream(self._side):
                works.append(finish())
        current.wait_stream(self._side)
        for work in works:
            if work is not None:
                work.wait()  # for NCCL: the current stream waits, not the host


def legacy_reduce(world_size, group):
    """fairseq's legacy DDP reduction of one buffer: divide by the world size, then sum."""
    def reduce(bucket):
        bucket.div_(world_size)
        return dist.all_reduce(bucket, group=group, async_op=True)
    return reduce

