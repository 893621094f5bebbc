"""The device memory behind ``--ls-cuda-graphs``: one arena for the graphs, no idle eager cache.

Why: with the allocator's default behaviour, a process with ``--ls-cuda-graphs`` held far more
device memory than the same run without graphs, nearly as much as fairseq (docs/PERFORMANCE.md,
"Memory"). Three things add up:

* the graphs' private pool is a patchwork. PyTorch's caching allocator ``cudaMalloc``\\ s one
  segment per large request that no free block holds, and segments never merge. A later shape
  whose logits are a few MB larger than any free segment gets a new segment, so over many shapes
  the pool grows to several times what one step needs;
* the allocator's cache for the eager steps (first sightings of larger shapes, validation) keeps
  their activations' memory after they end, and graphs cannot use it (another pool);
* the one warm-up step on the capture stream leaves a cache of the same size that nothing uses
  again (the allocator keeps freed blocks per stream).

What ``GraphMemory`` does (``--ls-cuda-graphs-memory compact``, the default):

* **Arena.** Before the pool's first capture, the pool gets one free segment as large as that
  capture is expected to need: the warm-up step's footprint, scaled by how many more tokens the
  shape has, times ``HEADROOM``. It is allocated and freed in the pool
  (``torch.cuda.use_mem_pool``), so it stays there, and each capture's tensors split it and coalesce
  back into it when they are freed: shapes of other sizes reuse the same memory instead of adding
  segments sized for their own tensors. A capture that needs more gets segments from the allocator
  as before (only memory is at stake, never correctness). One arena, not grown later: a second
  segment allocated to extend it would be taken out of the first one's free space instead (best
  fit).
* **Release.** The default pool's free cache goes back to the driver (``torch.cuda.empty_cache``)
  right after the warm-up, and after eager computations, at most once every 16 graph steps (a
  release synchronises the device, and the next eager step allocates afresh).
* **No eager training step beside the pool** (``CudaGraphedLoss._grow_lazy_state``): with
  first-sighting captures, a shape larger than every step so far grows the model's lazy state in
  a forward without gradients and is captured at once, instead of running an eager step whose
  activations would sit next to the idle pool (that step set the process's peak).

The memory held with and without it, at the same speed: docs/PERFORMANCE.md, "Memory".

``grow`` keeps the allocator's default behaviour. Without
``torch.cuda.MemPool`` and ``torch.cuda.use_mem_pool`` (older torch) there is no arena, only the
release and the gradient-free forward.
"""
import contextlib
import logging
import math
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

MEMORY_CHOICES = ("compact", "grow")  # --ls-cuda-graphs-memory

HEADROOM = 1.1  # the arena over the expected need: the allocator rounds, shapes differ in mix
RELEASE_EVERY = 16  # graph steps at least between two releases of the eager cache
_MIN_ARENA = 64 << 20  # smaller needs are left to the allocator
_KEEP_FREE = 1 << 30  # an arena never takes the device's last GiB


def token_counts(shapes: Sequence[Sequence[int]]) -> tuple:
    """Per input of two or more dimensions (token tensors: source, decoder input, target), its
    element count; 1-D inputs (lengths) say little about the memory a step needs."""
    return tuple(math.prod(shape) for shape in shapes if len(shape) >= 2)


def expected_need(unit, shapes) -> Optional[int]:
    """Bytes a capture of a step with these input shapes is expected to need, from ``unit`` =
    (bytes, token_counts) measured on another step: scaled by the largest ratio of token counts
    (memory grows with the tokens of each side), plus ``HEADROOM``. None: no estimate."""
    if unit is None:
        return None
    unit_bytes, unit_counts = unit
    counts = token_counts(shapes)
    if not counts or len(counts) != len(unit_counts):
        return None
    scale = max(n / u for n, u in zip(counts, unit_counts))
    return int(unit_bytes * scale * HEADROOM)


class GraphMemory:
    """The graphs' memory pool and the release of the eager cache, for one ``CudaGraphedLoss``."""

    def __init__(self, device: torch.device, compact: bool = True):
        self.device = device
        self.compact = compact
        self._mem_pool = None
        self.handle = None  # the pool handle captures use (capture_begin(pool=...))
        self.arena_bytes = 0
        self._unit = None  # (bytes, token_counts) of the warm-up step
        self._dirty = False  # eager work ran since the last release
        self._since_release = RELEASE_EVERY
        self.stats = {"released": 0}
        self.new_pool()

    def new_pool(self):
        """A fresh pool (the graphs of the old one are gone)."""
        self.arena_bytes = 0
        self._arena_tried = False
        if self.compact and hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda,
                                                                       "use_mem_pool"):
            self._mem_pool = torch.cuda.MemPool()
            self.handle = self._mem_pool.id
        else:
            self._mem_pool = None
            self.handle = torch.cuda.graph_pool_handle()

    # -- the eager cache -----------------------------------------------------------------------

    def eager_ran(self):
        """An eager computation ran (its freed activations now sit in the default cache)."""
        self._dirty = True

    def graph_step(self):
        """Before each capture or replay: release the eager cache if it is due."""
        self._since_release += 1
        if self.compact and self._dirty and self._since_release >= RELEASE_EVERY:
            self.release()

    def release(self):
        torch.cuda.empty_cache()
        self._dirty = False
        self._since_release = 0
        self.stats["released"] += 1

    @contextlib.contextmanager
    def warm_up(self, shapes):
        """Around the warm-up step, which runs eagerly on the (fresh) capture stream: what the
        allocator reserved for it is the arena's unit. Released afterwards."""
        before = torch.cuda.memory_reserved(self.device)
        yield
        footprint = torch.cuda.memory_reserved(self.device) - before
        counts = token_counts(shapes)
        if footprint > 0 and counts and min(counts) > 0:
            self._unit = (footprint, counts)
        if self.compact:
            self.release()

    # -- the arena -------------------------------------------------------------------------------

    @property
    def arena_tried(self) -> bool:
        """This pool's arena was attempted (``reserve`` ran before its first capture)."""
        return self._arena_tried

    def reserve(self, shapes, stream: torch.cuda.Stream):
        """Before capturing a step of these input shapes on ``stream``: if the pool has no arena
        yet, allocate one of the expected need and free it into the pool."""
        if self._mem_pool is None or self._arena_tried:
            return
        self._arena_tried = True
        need = expected_need(self._unit, shapes)
        if need is None or need < _MIN_ARENA:
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > free - _KEEP_FREE:
            logger.info(f"--ls-cuda-graphs-memory compact: {need / 2**30:.1f} GiB for the "
                        f"graphs' arena is not free ({free / 2**30:.1f} GiB); the pool grows "
                        "segment by segment instead")
            return
        try:
            with torch.cuda.stream(stream), torch.cuda.use_mem_pool(self._mem_pool):
                block = torch.empty(need, dtype=torch.uint8, device=self.device)
                del block  # back to the pool's free blocks, where the captures find it
        except torch.cuda.OutOfMemoryError:
            return
        self.arena_bytes = need
