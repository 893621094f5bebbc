"""Training forward and backward replayed as CUDA graphs, one pair per batch shape: the engine
(``CudaGraphedLoss``).

Why: the ls_ model's forward and backward issue hundreds of kernels, and on a fast GPU issuing
them from Python takes longer than the GPU needs to run them (``bench/host_overhead.py`` measures
both; docs/PERFORMANCE.md). A replayed CUDA graph issues the same kernels with one call.

How (used by ``ls_label_smoothed_cross_entropy --ls-cuda-graphs``):

* A batch shape (the shapes and dtypes of ``net_input`` and ``target``) not kept captured is
  captured at its second sighting; its first sighting runs eagerly as usual (lazily grown tables).
  With ``capture_first_sighting`` (the criterion's default when batches are padded to bucketed
  shapes, which recur) it is captured at once, unless it is larger in some dimension than every
  step run so far (``capture_policy.CapturePolicy``): then it runs eagerly first, or, with
  ``--ls-cuda-graphs-memory compact`` (the default), a forward without gradients grows the lazy
  state and the shape is captured at once (``_grow_lazy_state``). Capturing means: the criterion's
  forward (model + loss) is captured into one graph and ``torch.autograd.grad`` of the loss into a
  second, which writes the gradients into fixed accumulator buffers; the step itself is then the
  first replay. A backward graph captured at an update's first micro-batch overwrites the
  accumulators (nothing to add to; the flat buffers need no zeroing); once an update of several
  micro-batches (``--update-freq``) is seen, the graphs that overwrite are dropped and new ones
  add into the accumulators, as they always do under legacy DDP's bucketed all-reduce. Before the
  first capture, one more eager step on the capture stream (gradients dropped, dropout draws
  undone) sets that stream up (cuBLAS workspace and handles); later shapes capture without it,
  which makes each capture cheaper (``bench/capture_cost.py`` measures a capture against an eager
  step).
* The forward replay returns a loss whose backward (called by fairseq's optimizer wrapper as
  usual, e.g. ``(loss * loss_scale).backward()``) copies the incoming gradient (the loss scale, or
  0 after fairseq's ``loss *= 0`` for dummy batches) into the backward graph and replays it. The
  accumulators (``flat_gradients.FlatGradients``) become the parameters' ``.grad`` (zeroed or
  overwritten when fairseq has set ``.grad`` to None), so ``--update-freq`` accumulation, gradient
  clipping and every fairseq optimizer wrapper work unchanged. Eager steps (e.g. a shape's first
  sighting) accumulate into the same buffers: with several GPUs every rank then all-reduces the
  same flat buffers in the same NCCL calls, whether its step was replayed or not (otherwise a rank
  running fairseq's packed all-reduce next to one all-reducing padded flat buffers would pair
  collectives of different sizes).
* All graphs share one memory pool: their temporaries (activations) reuse the same memory, which
  is safe because a shape's forward and backward replay back to back. If a second forward comes
  before the first one's backward, the second runs eagerly (it must not overwrite activations
  still waiting for their backward). ``memory.GraphMemory`` keeps that pool one arena and
  gives the eager steps' idle cache back to the driver (``--ls-cuda-graphs-memory``).
* The graphs run the model on aliases of its parameters (same storage, their own autograd
  leaves), so they never depend on autograd state of eager steps (``_check_aliases``).
* Dropout stays random: the CUDA generator is graph-aware and every replay advances its offset
  (the same Philox stream an eager step would use).

* Several GPUs: the captured backward adds the gradients into the accumulators bucket by
  bucket (``distributed/grad_buckets.py``) and records an external CUDA event after each bucket.
  At the end of the backward of an update's last micro-batch (replayed or eager) the engine's
  ``distributed.GradientReducer`` all-reduces the buckets on a side stream, each as soon as its
  event fires, so the all-reduce runs under the rest of the backward; ls_adam's
  ``all_reduce_grads`` then takes the update's ``GradientExchange`` from it and finds the buffers
  done (``distributed/flat_all_reduce.py``). The reduction is both wrappers' (divide by the world
  size, sum), in the gradients' dtype. On GPUs of one host with peer access the buckets travel by
  copy engines instead of NCCL's kernels (``distributed/peer_all_reduce.py``: the same average,
  summed in float32; decided with every rank at the first update).

  - fairseq's ``--ddp-backend legacy_ddp``/``no_c10d``: ``--ls-all-reduce-bucket-mb 0`` leaves
    the whole all-reduce to ``all_reduce_grads`` instead.
  - torch DDP (``--ddp-backend c10d``/``pytorch_ddp``, fairseq's default) all-reduces from
    per-parameter autograd hooks, which a replayed backward never calls. So every training step
    (replayed or eager) runs the model inside DDP, not DDP's forward: DDP then never prepares its
    reducer and its hooks stay idle, and the engine all-reduces the flat buffers itself at the end
    of every update's backward, with DDP's process group (``--ls-all-reduce-bucket-mb 0``: in one
    piece after the backward). Validation and anything else without gradients still goes
    through DDP's forward. DDP's communication hooks (``--ddp-comm-hook``) are not applied.

Limits: graphs hold their kernels' arguments and one pool of activation memory; ``max_graphs``
bounds their number (least recently used are dropped). Without CUDA the eager path runs (one
warning).
"""
import collections
import contextlib
import functools
import logging
import types
import weakref

import torch

from .. import switches
from ..cuda_capture import collector_paused
from ..distributed import GradientReducer
from ..distributed.exchange import register
from ..wrappers import data_parallel_of, grad_sync_due, innermost, is_torch_ddp
from .capture_policy import CapturePolicy
from .flat_gradients import FlatGradients
from .memory import MEMORY_CHOICES, GraphMemory

logger = logging.getLogger(__name__)

FLAG = "--ls-cuda-graphs"


class _Graphs:
    """The captured forward/backward pair of one batch shape and its static tensors."""

    def __init__(self, static_inputs, outputs, grad_output, fwd, bwd, ready, overwrites):
        self.static_inputs = static_inputs
        self.outputs = outputs  # static output tensors of the forward graph (None kept as None)
        self.grad_output = grad_output
        self.fwd = fwd
        self.bwd = bwd
        self.ready = ready  # per gradient bucket, the external event the backward replay records
        # the backward writes the gradients into the accumulators instead of adding them
        # (captured at the first micro-batch of an update: CudaGraphedLoss._grads)
        self.overwrites = overwrites


@contextlib.contextmanager
def _parameters_swapped(model, replacement):
    """Within the block, every module slot holding a parameter ``p`` holds ``replacement[id(p)]``.

    Written out rather than ``torch.func.functional_call``: with a module shared between two
    parents (fairseq's shared encoder/decoder embedding), torch 2.11's functional_call leaves the
    replacement in the model after the call. Here each module object is visited once and every
    slot is restored from what it held."""
    slots = [(m, k, p) for m in model.modules() for k, p in m._parameters.items()
             if p is not None and id(p) in replacement]
    try:
        for m, k, p in slots:
            m._parameters[k] = replacement[id(p)]
        yield
    finally:
        for m, k, p in slots:
            m._parameters[k] = p


class _ReplayBackward(torch.autograd.Function):
    """Gives the replayed loss a backward: it replays the shape's backward graph."""

    @staticmethod
    def forward(ctx, runner, graphs, anchor):
        ctx.runner, ctx.graphs = runner, graphs
        return graphs.outputs[0].clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.runner._replay_backward(ctx.graphs, grad)
        return None, None, None


class _EagerBackward(torch.autograd.Function):
    """Marks the start of an eager step's backward: the reducer queues the gradient all-reduce
    for the end of that autograd pass."""

    @staticmethod
    def forward(ctx, reducer, loss):
        ctx.reducer = reducer
        return loss.clone()  # not a view: fairseq may scale the loss in place (loss *= 0)

    @staticmethod
    def backward(ctx, grad):
        ctx.reducer.queue()
        return None, grad


class CudaGraphedLoss:
    """Runs ``compute(model, sample) -> (loss, *other tensors or None)`` through CUDA graphs.

    One instance per criterion (no process-wide state). ``loss`` must be a scalar; the other
    outputs (``nll_loss``, accuracy counts) come back without gradient.
    """

    def __init__(self, max_graphs: int = 256, bucket_mb: float = 25.0,
                 capture_first_sighting: bool = False, memory: str = "compact",
                 required: bool = False, copy_engine: str = switches.AUTO):
        switches.at_least("--ls-all-reduce-bucket-mb", bucket_mb, 0)
        if memory not in MEMORY_CHOICES:
            raise switches.Refused(f"--ls-cuda-graphs-memory must be one of "
                                   f"{', '.join(MEMORY_CHOICES)}, got {memory!r}")
        self.memory = memory
        self.required = required  # --ls-cuda-graphs given: where they cannot apply, refuse
        # --ls-(no-)copy-engine-all-reduce: switches.AUTO / ON / OFF (the reducer's choice)
        self.copy_engine = copy_engine
        self.off_reason = None  # why the graphs stepped aside for this run (see applies)
        self.max_graphs = max_graphs
        self.bucket_mb = bucket_mb  # 0: no all-reduce during the backward
        self._graphs = collections.OrderedDict()  # key -> _Graphs, least recently used first
        self.policy = CapturePolicy(capture_first_sighting)
        self._memory = None  # GraphMemory: the graphs' pool, created at the first capture
        self._stream = None
        self._model_ref = None
        # the model's gradient accumulators (flat_gradients.FlatGradients) and their all-reduce
        # (distributed.GradientReducer, registered for the model: distributed.exchange_of finds
        # it), created by _setup
        self.flat_gradients = None
        self._reducer = None
        self._aliases = None
        self._alias_ptrs = None
        self._on_alias_grad = None  # set while a backward is being captured
        # bucket -> work, handed to the reducer at _setup; None: NCCL's or the copy engines'
        # reduction (tests swap it)
        self.reduce_bucket = None
        self._anchor = None
        self._pending = None  # weakref to the replayed loss whose backward has not run yet
        self._warned_cpu = False
        self._stream_warm = False  # the capture stream has run one eager warm-up step
        # an update of several micro-batches was seen: new backward graphs add into the
        # accumulators (until then they overwrite them, see _grads)
        self._accumulating = False
        self.stats = collections.Counter()  # eager / captured / replayed calls (for tests/logs)

    # -- public ------------------------------------------------------------------------------

    # read-only views of the engine's state (for tests and logs; None before the first
    # graphable step where noted)
    @property
    def reducer(self):
        """The gradient all-reduce (``distributed.GradientReducer``) of the model's flat
        gradients; None before the first graphable step."""
        return self._reducer

    @property
    def captured(self):
        """Read-only view of the graphs held: batch-shape key -> the captured forward/backward
        pair (its ``overwrites``: the backward overwrites the accumulators instead of adding),
        least recently used first."""
        return types.MappingProxyType(self._graphs)

    @property
    def graph_memory(self):
        """The graphs' memory pool (``memory.GraphMemory``); None before the first capture."""
        return self._memory

    @property
    def capture_stream(self):
        """The stream graphs are captured on; None before the first capture."""
        return self._stream

    @property
    def accumulating(self) -> bool:
        """An update of several micro-batches was seen: backward graphs add into the
        accumulators (see ``_grads``)."""
        return self._accumulating

    # the parts of flat_gradients the engine works with (None before _setup)
    @property
    def _params(self):
        return None if self.flat_gradients is None else self.flat_gradients.params

    @property
    def _flats(self):
        return None if self.flat_gradients is None else self.flat_gradients.flats

    @property
    def _accumulators(self):  # per-parameter views of the flat per-dtype buffers
        return None if self.flat_gradients is None else self.flat_gradients.views

    def applies(self, model, sample) -> bool:
        """Whether this training call may run through the graphs. Where they cannot apply for
        the run (by default a model not known to be capturable; batches on the CPU) they step
        aside for good with one log line, or, with ``--ls-cuda-graphs`` given, the run is refused
        (fairseq-train refuses a CPU run before it starts: the criterion's ``check_run``).
        Outside fairseq-train, a CPU batch under ``--ls-cuda-graphs`` runs eagerly (one
        warning)."""
        if self.off_reason is not None:
            return False
        if not self.required and not getattr(innermost(model), "supports_cuda_graphs", False):
            self.off_for_run(f"the model ({type(innermost(model)).__name__}) is not an "
                             f"ls_transformer, whose training step is known to be capturable; "
                             f"pass --ls-cuda-graphs to try it anyway")
            return False
        target = sample.get("target") if isinstance(sample, dict) else None
        if torch.is_tensor(target) and not target.is_cuda:
            if not self.required:
                self.off_for_run("the batches are on the CPU, and CUDA graphs need a GPU")
            elif not self._warned_cpu:
                self._warned_cpu = True
                logger.warning(f"{FLAG}: the batch is not on a CUDA device; training runs "
                               f"eagerly (no CUDA graphs)")
            return False
        return True

    def off_for_run(self, reason: str) -> None:
        """The graphs cannot apply to this run (``reason``): refused with ``--ls-cuda-graphs``,
        else they step aside with one log line and every training step runs eagerly."""
        if self.off_reason is None:
            switches.refuse_or_step_aside(switches.ON if self.required else switches.AUTO, FLAG,
                                          reason, logger)
            self.off_reason = reason

    def __call__(self, model, sample, compute):
        ddp = data_parallel_of(model)
        if is_torch_ddp(ddp):
            model = self._inside_torch_ddp(ddp)
        elif self.bucket_mb <= 0:
            ddp = None  # legacy DDP: ls_adam's all_reduce_grads reduces after the backward
        # the backward ends the update: all-reduce the gradients at its end
        sync = ddp if ddp is not None and grad_sync_due(ddp) else None
        key = self._key(model, sample)
        if key is None:
            if is_torch_ddp(ddp):  # DDP's reducer is idle: these gradients are the engine's too
                self._setup(model)
                return self._eager(model, sample, compute, sync, None)
            self.stats["eager"] += 1
            self._eager_ran()
            return compute(model, sample)
        self._setup(model)
        if self._pending is not None:
            if self._pending() is not None:  # a replayed loss still waits for its backward
                return self._eager(model, sample, compute, sync, key)
            self._pending = None
        self._check_aliases()  # drops the graphs if a parameter's storage was replaced
        graphs = self._graphs.get(key)
        if graphs is None:
            if not self.policy.capture(*key):
                if not (self.policy.first_sighting and self.memory == "compact"):
                    return self._eager(model, sample, compute, sync, key)
                self._grow_lazy_state(model, sample, compute)
            # under legacy DDP the graphs keep adding: each bucket's all-reduce waits on the
            # event recorded after its add, which a later micro-batch's replay must not undo
            graphs = self._capture(model, sample, compute, key[1], record_ready=ddp is not None,
                                   overwrite=ddp is None and not self._accumulating
                                   and self.flat_gradients.fresh())
            self.policy.ran(*key)
            self._graphs[key] = graphs
            self.stats["captured"] += 1
            n = self.stats["captured"]
            if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: enough to follow, not one line per shape
                logger.info(f"--ls-cuda-graphs: captured {n} batch shape(s) so far "
                            f"(latest {list(key[1][-1])} target tokens)")
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            self._memory.graph_step()
        if sync is not None:
            self._reducer.expect(sync, graphs.ready)
        return self._replay_forward(graphs, sample)

    # -- internals ---------------------------------------------------------------------------

    def _inside_torch_ddp(self, ddp):
        """The model inside torch DDP, which every training step runs (see the module doc)."""
        if not self.stats["inside_torch_ddp"]:
            logger.info("--ls-cuda-graphs: under torch DDP (--ddp-backend c10d/pytorch_ddp) the "
                        "training steps run inside DDP and the engine all-reduces the gradients "
                        "itself (flat buffers, DDP's process group; same average)")
        self.stats["inside_torch_ddp"] += 1
        return ddp.module

    def _key(self, model, sample):
        """Shape key of a graphable call, (signature, shapes), or None when this call must run
        eagerly. The signature is what the shapes do not say (model, input names and dtypes)."""
        if not (torch.is_grad_enabled() and model.training):
            return None
        net_input, target = sample.get("net_input"), sample.get("target")
        if not isinstance(net_input, dict) or not torch.is_tensor(target):
            return None
        tensors = [net_input[k] for k in sorted(net_input)] + [target]
        if not all(torch.is_tensor(t) for t in tensors):
            return None
        if not all(t.is_cuda for t in tensors):
            if not self._warned_cpu:
                self._warned_cpu = True
                logger.warning(f"{FLAG}: the batch is not on a CUDA device; training runs "
                               f"eagerly (no CUDA graphs)")
            return None
        signature = (id(model), tuple(sorted(net_input)), torch.is_autocast_enabled(),
                     tuple((t.dim(), t.dtype, t.device) for t in tensors))
        return signature, tuple(tuple(t.shape) for t in tensors)

    def _eager(self, model, sample, compute, sync_ddp, key):
        """An eager training step whose backward accumulates into the flat buffers, as a
        replay's does: with several GPUs every rank then all-reduces the same buffers in the
        same calls whether its step replayed or not."""
        self.stats["eager"] += 1
        self._eager_ran()
        fresh = self.flat_gradients.fresh()
        self.flat_gradients.bind(fresh)
        if fresh:
            self._reducer.start_update()
        out = compute(model, sample)
        if key is not None:
            self.policy.ran(*key)
        if sync_ddp is None:
            return out
        self._reducer.expect(sync_ddp, None)
        return (_EagerBackward.apply(self._reducer, out[0]),) + tuple(out[1:])

    def _grow_lazy_state(self, model, sample, compute):
        """Instead of an eager first step of a shape larger than every step so far (first
        sighting captures with compact memory): a forward without gradients, in eval mode and
        with the CUDA RNG state put back, so that what the model grows lazily for larger inputs
        (fairseq's sinusoidal positional table) grows outside a capture, as an eager step would
        grow it. The shape is then captured at once. An eager training step would hold its
        activations next to the graphs' idle pool (the process's peak memory); this forward
        holds none for a backward, and its cache is given back right away."""
        self.stats["dry_run"] += 1
        rng = torch.cuda.get_rng_state()
        training = model.training
        try:
            with torch.no_grad():
                model.eval()
                compute(model, sample)
        finally:
            model.train(training)
            torch.cuda.set_rng_state(rng)
        if self._memory is not None:  # else the first capture's warm-up releases it
            self._memory.release()

    def _eager_ran(self):
        if self._memory is not None:  # its activations' memory is now cached outside the graphs
            self._memory.eager_ran()

    def _start_accumulating(self):
        """Updates have several micro-batches (--update-freq): from now on backward graphs add
        into the accumulators; those that overwrite them are dropped (captured again when their
        shape comes back)."""
        self._accumulating = True
        dropped = [k for k, g in self._graphs.items() if g.overwrites]
        for key in dropped:
            del self._graphs[key]
        if dropped and not self._graphs and self._memory is not None:
            # a pool all of whose graphs are gone cannot be captured into again (torch 2.11's
            # host allocator asserts in capture_begin); the next captures get a fresh one
            self._memory.new_pool()
        self.stats["dropped_overwriting"] += len(dropped)
        logger.info("--ls-cuda-graphs: updates of several micro-batches: gradients are added "
                    "into the accumulators from now on")

    def _setup(self, model):
        if self._model_ref is not None and self._model_ref() is model:
            return
        if self._model_ref is not None:
            raise ValueError("--ls-cuda-graphs: one criterion trains one model")
        self._model_ref = weakref.ref(model)
        self.flat_gradients = FlatGradients(p for p in model.parameters() if p.requires_grad)
        self._reducer = GradientReducer(self.flat_gradients, self.bucket_mb, self.copy_engine,
                                        self.reduce_bucket, self.stats)
        register(model, self._reducer)
        self._anchor = torch.zeros((), device=self._params[0].device, requires_grad=True)

    def _check_aliases(self):
        """The graphs run the model on aliases of its parameters: leaves of their own that share
        the parameters' storage (so replays read the current weights) but not their autograd
        state. A parameter's gradient-accumulator node remembers the stream it was created on;
        while any eager graph of the model is alive (a loss someone still holds), that is the
        default stream, and a backward captured against the parameters themselves would make the
        default stream wait on the capture ("operation would make the legacy stream depend on a
        capturing blocking stream"). If a parameter's storage was replaced (``p.data = ...``,
        ``model.half()``), the graphs read stale memory: drop them and alias again."""
        ptrs = tuple(p.data_ptr() for p in self._params)
        if ptrs == self._alias_ptrs:
            return
        dropped = bool(self._graphs)
        if dropped:
            logger.info("--ls-cuda-graphs: parameter storage changed; re-capturing")
            self._graphs.clear()
            if self._memory is not None:
                self._memory.new_pool()  # a fresh memory pool for the new graphs
        self._aliases = [p.detach().requires_grad_() for p in self._params]
        for i, a in enumerate(self._aliases):
            a.register_hook(functools.partial(self._alias_grad, i))
        self._alias_ptrs = ptrs
        if dropped and self._memory is not None and self._memory.compact:
            # the old pool and the old weights' blocks (ls_adam's sharded step moves the weights
            # into flat buffers) are free now: back to the driver, not kept cached
            self._memory.release()

    def _alias_grad(self, i, grad):
        if self._on_alias_grad is not None:  # only while a backward is being captured
            self._on_alias_grad(i, grad)

    def _run(self, model, sample, compute):
        """compute(model, sample) with the parameters swapped for their aliases."""
        with _parameters_swapped(model, {id(p): a for p, a in zip(self._params, self._aliases)}):
            return compute(model, sample)

    def _static_sample(self, sample, static_inputs):
        keys = sorted(sample["net_input"])
        return {"net_input": dict(zip(keys, static_inputs[:-1])), "target": static_inputs[-1]}

    def _grads(self, outputs, grad_output, record_ready, overwrite):
        """The backward (being captured): each bucket's gradients are added into the
        accumulators as soon as the last of them is computed, then (``record_ready``) an external
        event is recorded, which each replay signals. Returns the events (or None).

        ``overwrite`` (captured at an update's first micro-batch, while no update of several
        micro-batches has been seen, and not under legacy DDP): the gradients are copied into
        the accumulators and those of parameters without a gradient zeroed, so the replay need
        not zero the flat buffers first nor read them (a copy instead of a zeroing pass and an
        add: one pass over the gradients less per update)."""
        buckets = self._reducer.buckets
        left = list(buckets.sizes)
        pairs = [[] for _ in left]
        got = [False] * len(self._accumulators)
        ready = [None] * len(left)

        def flush(b):  # on autograd's device thread: name the stream being captured
            with torch.cuda.stream(self._stream):
                if pairs[b]:
                    store = torch._foreach_copy_ if overwrite else torch._foreach_add_
                    store([a for a, _ in pairs[b]], [g for _, g in pairs[b]])
                if overwrite and left[b] > 0:  # parameters of this bucket that got no gradient
                    torch._foreach_zero_([a for i, a in enumerate(self._accumulators)
                                          if buckets.bucket_of[i] == b and not got[i]])
                if record_ready:
                    ready[b] = torch.cuda.Event(external=True)
                    ready[b].record(self._stream)
            left[b] = -1

        def on_grad(i, grad):
            b = buckets.bucket_of[i]
            if grad is not None:
                pairs[b].append((self._accumulators[i], grad))
                got[i] = True
            left[b] -= 1
            if left[b] == 0:
                flush(b)

        self._on_alias_grad = on_grad
        try:
            torch.autograd.grad(outputs[0], self._aliases, grad_outputs=grad_output,
                                allow_unused=True)
        finally:
            self._on_alias_grad = None
        for b in range(len(left)):
            if left[b] > 0:  # some of its parameters got no gradient in this backward
                flush(b)
        return ready if record_ready else None

    def _capture(self, model, sample, compute, shapes, record_ready=False, overwrite=False):
        """Captures the step of ``sample``, whose inputs have ``shapes`` (the key's: net_input
        by name, then target); ``overwrite``: see ``_grads``."""
        device = self._params[0].device
        if self._memory is None:
            self._memory = GraphMemory(device, compact=self.memory == "compact")
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        keys = sorted(sample["net_input"])
        static_inputs = [sample["net_input"][k].clone() for k in keys] + [sample["target"].clone()]
        static_sample = self._static_sample(sample, static_inputs)
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        if not self._stream_warm:
            with self._memory.warm_up(shapes):
                self._warm_up(model, static_sample, compute)
            self._stream_warm = True
        self._memory.graph_step()
        self._memory.reserve(shapes, self._stream)
        # capture_begin/end rather than torch.cuda.graph(): that context manager also runs
        # gc.collect() and empties the allocator cache at every capture
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                outputs = self._captured(fwd, lambda: self._run(model, static_sample, compute))
                if not torch.is_tensor(outputs[0]) or outputs[0].dim() != 0:
                    raise ValueError("the criterion's loss must be a scalar tensor")
                grad_output = torch.ones_like(outputs[0])
                ready = self._captured(bwd, lambda: self._grads(outputs, grad_output, record_ready,
                                                                overwrite))
        except Exception as exc:
            hint = (" (or, if this names the memory pool, with --ls-cuda-graphs-memory grow)"
                    if self.memory == "compact" else "")
            raise RuntimeError(
                f"--ls-cuda-graphs: capturing the training step of a batch of "
                f"{list(static_inputs[-1].shape)} target tokens failed ({exc}). Train without "
                f"--ls-cuda-graphs{hint}, and please report this.") from exc
        current.wait_stream(self._stream)
        static_outputs = tuple(o.detach() if torch.is_tensor(o) else o for o in outputs)
        return _Graphs(static_inputs, static_outputs, grad_output, fwd, bwd, ready, overwrite)

    def _warm_up(self, model, sample, compute):
        """One eager step on the capture stream, its gradients dropped and its dropout draws
        undone, before the first capture (as torch's make_graphed_callables does): the libraries
        set up what they keep per stream (cuBLAS workspace and handles) outside a capture.
        Captures without any warm-up failed in cublasGemmEx (CUBLAS_STATUS_EXECUTION_FAILED).
        Once the stream is set up, shapes capture without it, also at their first sighting
        (kernels not loaded yet then load during the capture, which CUDA drivers from 12.3 on
        allow): ``bench/capture_cost.py`` and whole fairseq-train runs (``bench/e2e.py``)
        capture all their shapes after this one warm-up."""
        rng = torch.cuda.get_rng_state()
        with torch.cuda.stream(self._stream):
            outputs = self._run(model, sample, compute)
            torch.autograd.grad(outputs[0], self._aliases, allow_unused=True)
            del outputs
        torch.cuda.synchronize()
        torch.cuda.set_rng_state(rng)

    def _captured(self, graph, fn):
        """fn() captured into graph. If fn raises, that error is the one reported (ending the
        broken capture raises a second, uninformative one, which is dropped)."""
        # thread_local: only this thread is barred from calls that are unsafe during a capture.
        # In the default global mode a call from any thread breaks the capture, and fairseq's
        # data loader pins memory (cudaHostAlloc, event queries) on its own thread meanwhile.
        with collector_paused():  # a collected MemPool would abort the process mid-capture
            graph.capture_begin(pool=self._memory.handle, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture is already broken by the error above
                    pass
                raise
            graph.capture_end()
        return out

    def _replay_forward(self, graphs, sample):
        keys = sorted(sample["net_input"])
        for static, new in zip(graphs.static_inputs,
                               [sample["net_input"][k] for k in keys] + [sample["target"]]):
            static.copy_(new)
        graphs.fwd.replay()
        self.stats["replayed"] += 1
        loss = _ReplayBackward.apply(self, graphs, self._anchor)
        self._pending = weakref.ref(loss)
        rest = tuple(o.clone() if torch.is_tensor(o) else o for o in graphs.outputs[1:])
        return (loss,) + rest

    def _replay_backward(self, graphs, grad):
        self._pending = None
        graphs.grad_output.copy_(grad.reshape(graphs.grad_output.shape))
        fresh = self.flat_gradients.fresh()
        foreign = self.flat_gradients.bind(fresh, zero=not graphs.overwrites)
        if fresh:
            self._reducer.start_update()
        if graphs.overwrites and not fresh:
            # a later micro-batch of an update: this graph would overwrite the earlier ones' sum
            earlier = [flat.clone() for flat in self._flats]
            graphs.bwd.replay()
            torch._foreach_add_(self._flats, earlier)
            self._start_accumulating()
        else:
            graphs.bwd.replay()
        for p, acc in foreign:
            p.grad.add_(acc)
        self._reducer.queue()
