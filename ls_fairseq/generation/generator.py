"""``LSSequenceGenerator``: fairseq's ``SequenceGenerator`` with a fixed-shape, graph-replayed
beam search for ls_ models.

``fairseq-generate`` and ``fairseq-interactive`` build their generator with
``task.build_generator``; with ``--user-dir ls_fairseq`` and ls_transformer models that builds
this class (``ls_fairseq.fairseq_patches``, patch 5). It takes fairseq's options unchanged. A
batch is decoded by :meth:`LSSequenceGenerator._generate`:

1. the encoder runs once; the cross-attention keys/values of every decoder layer come from one
   GEMM over the sentences and stay stored once per sentence in a workspace buffer (each beam
   reads its sentence's through ``ops.decode_attention``);
2. every step runs the same work: the decoder step over a
   :class:`~ls_fairseq.modules.kv_cache.StaticKVCache`, log-softmax, and one
   :class:`~ls_fairseq.generation.beam_search.BeamState` step (top-k, finalisation,
   reordering: of the cache's row table, not of its keys/values). For fp16/bf16 models on a
   GPU the step has fixed shapes and is captured as a CUDA graph the first time a shape occurs,
   then replayed; the host reads the number of unfinished sentences one step late, so the GPU
   never waits for it. Elsewhere (fp32, the CPU, ``LS_FAIRSEQ_GENERATOR=eager``) the same step
   runs eagerly over the exact lengths;
3. once at most ``1/SHRINK`` of a batch's sentences are unfinished, they move to the workspace
   of the next power of two (fairseq drops finished sentences at every step);
4. the hypotheses are read out at the end (and at each shrink), in fairseq's format and order.

Shapes: a workspace per (sentences, beam) holds every buffer, reused by later batches of that
shape; with graphs, a batch's sentences round up to a power of two up to 8, then to a multiple
of 8 (the extra sentences repeat the first one and are finished from the start); the least
recently used workspaces are dropped past ``MAX_WORKSPACES`` or ``WORKSPACE_MEMORY``. With graphs,
the source length is rounded up to a power of two (>= 16; ``SOURCE_BUCKET`` > 0: a multiple of
it) and the self-attention capacity is a power of two from
``INITIAL_CAPACITY`` up to ``max_len + 1``, with the extra positions masked; one graph per
(source bucket, capacity, first step or not) of a workspace.

Where it does not apply (an ensemble, ``--sampling``, ``--diverse-beam-*``, ``--match-source-len``,
``--no-repeat-ngram-size``, ``--lm-path``, ``--prefix-size``, ``--constraints``, tokens to suppress,
or a model other than ls_transformer) fairseq's own ``_generate`` runs, with one log line naming
the option. ``LS_FAIRSEQ_GENERATOR=fairseq`` turns it off; ``=eager`` replays no graphs.
"""
import logging
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor

from ..cuda_capture import collector_paused
from ..models.ls_transformer import LSTransformerDecoder
from ..modules.kv_cache import StaticKVCache
from ..ops import _extension
from .beam_search import BeamState

logger = logging.getLogger(__name__)

ENV = "LS_FAIRSEQ_GENERATOR"  # its values: ops/_extension.py's ENV_VARS
#: source lengths round up to a multiple of this on a GPU (0: to a power of two, >= 16)
SOURCE_BUCKET = 0
INITIAL_CAPACITY = 16
#: a batch shrinks when at most 1/SHRINK of its sentences are unfinished
SHRINK = 8
#: eager steps with the graphs' padded shapes (tests compare the two bit for bit)
PAD_EAGER = False
#: workspaces kept for later batches, at most (see LSSequenceGenerator._workspace)
MAX_WORKSPACES = 8
#: and at most this share of the GPU's memory in their buffers
WORKSPACE_MEMORY = 0.3


def _batch_bucket(bsz: int) -> int:
    """The workspace of a batch of ``bsz`` sentences: a power of two up to 8, then a multiple of
    8 (batches made by --max-tokens vary in size; fewer shapes, fewer workspaces and graphs)."""
    return 1 << (bsz - 1).bit_length() if bsz <= 8 else -(-bsz // 8) * 8


def mode() -> str:
    """``LS_FAIRSEQ_GENERATOR``: ``graphs`` (default; eager on a CPU), ``eager`` or ``fairseq``."""
    return _extension.env_value(ENV)


def _source_bucket(n: int) -> int:
    if SOURCE_BUCKET <= 0:
        return max(16, 1 << (n - 1).bit_length())
    return -(-n // SOURCE_BUCKET) * SOURCE_BUCKET


def _capture(graph: "torch.cuda.CUDAGraph", pool, fn) -> Optional[str]:
    """Captures ``fn()`` into ``graph`` on the current stream; the error, as text, if it fails.

    capture_begin/end, not torch.cuda.graph: that one empties the allocator's cache at every
    capture (a later batch would pay cudaMalloc again). ``thread_local``: only this thread is
    barred from calls that are unsafe during a capture; in the default global mode a call from
    any thread breaks it, and fairseq's data loader pins memory (cudaHostAlloc) on its own
    thread while fairseq-generate decodes. Captured work does not run, so after a failure the
    step has not happened."""
    error = None
    with collector_paused():  # a collected MemPool would abort the process mid-capture
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        except RuntimeError as e:  # a call the capture refused (ending it then raises again)
            error = e
        try:
            graph.capture_end()
        except RuntimeError as e:
            error = error or e
    return None if error is None else str(error).splitlines()[0]


class _Workspace:
    """Every buffer a decoding step of ``bsz`` sentences x ``beam`` touches, reused by the batches
    of that shape; the CUDA graphs captured over them, by (source bucket, capacity, first step)."""

    def __init__(self, gen: "LSSequenceGenerator", decoder: LSTransformerDecoder, bsz: int,
                 beam: int, src_len: int, width: int, dtype, device):
        self.bsz, self.beam, self.rows = bsz, beam, bsz * beam
        layer = decoder.layers[0].self_attn
        heads, head_dim = layer.num_heads, layer.head_dim
        layers = decoder.num_layers
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.state = BeamState(bsz, beam, width, gen.vocab_size, self.step, pad=gen.pad,
                               unk=gen.unk, eos=gen.eos, min_len=gen.min_len,
                               unk_penalty=gen.unk_penalty)
        self.dtype = dtype
        self.kv_shape = (layers, 2, self.rows, heads, head_dim)
        # self-attention keys/values per capacity: [L, 2, R, H, C, D], the mask and row table
        # [R, C] (StaticKVCache); made when first needed
        self.kv: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}
        # cross-attention keys/values once per sentence; each row reads its sentence's
        self.cross = torch.zeros(bsz, src_len, 2 * layers, heads, head_dim, dtype=dtype,
                                 device=device)
        self.cross_rows = torch.arange(self.rows, device=device) // beam
        self.cross_mask = torch.ones(self.rows, src_len, dtype=torch.bool, device=device)
        self.graphs: Dict[Tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.uncapturable = set()  # shapes whose capture failed: eager steps
        self.pool = None
        self.done: Optional[Tensor] = None  # pinned host counts, one per step parity
        self.events = [None, None]
        self.done_step = [-1, -1]  # the step whose count each slot holds (-1: none this run)
        self.previous_count: Optional[Tensor] = None  # eager: the count read one step late

    def nbytes(self) -> int:
        tensors = [self.cross, self.cross_rows, self.cross_mask]
        tensors += [t for group in self.kv.values() for t in group]
        tensors += [t for t in vars(self.state).values() if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def fits(self, src_len: int, width: int, dtype) -> bool:
        return (self.cross.size(1) >= src_len and self.state.width >= width
                and self.dtype == dtype)

    def buffers(self, capacity: int) -> Tuple[Tensor, Tensor, Tensor]:
        """The keys/values, mask and row table buffers of ``capacity`` positions."""
        if capacity not in self.kv:
            layers, two, rows, heads, head_dim = self.kv_shape
            device = self.step.device
            self.kv[capacity] = (
                torch.zeros(layers, two, rows, heads, capacity, head_dim, dtype=self.dtype,
                            device=device),
                torch.ones(rows, capacity, dtype=torch.bool, device=device),
                # valid row indices; the cache fills what it reads (reset, copy_from, select_from)
                torch.zeros(rows, capacity, dtype=torch.long, device=device))
        return self.kv[capacity]

    def cache(self, capacity: int, length: Optional[int] = None) -> StaticKVCache:
        """The cache over the first ``length`` (default: all) positions of ``capacity``."""
        kv, mask, table = self.buffers(capacity)
        length = capacity if length is None else length
        return StaticKVCache(kv[:, :, :, :, :length], mask[:, :length], self.step,
                             table[:, :length])

    def grow(self, capacity: int, new_capacity: int):
        """The positions so far move to the buffers of ``new_capacity``."""
        self.cache(new_capacity).copy_from(self.cache(capacity))

    def load(self, kv: Tensor, padding_mask: Optional[Tensor], src_len: int, bucket: int,
             bos: int):
        """A new batch: the sentences' cross-attention keys/values ``kv`` [bsz, S, 2L, H, D],
        the source padding (copied to the beams), an empty cache and search state."""
        bsz, beam = self.bsz, self.beam
        real = kv.size(0)  # the rest of the workspace's sentences repeat sentence 0, finished
        if real < bsz:
            fill = [0] * (bsz - real)
            kv = torch.cat([kv, kv[fill]])
            padding_mask = None if padding_mask is None else torch.cat(
                [padding_mask, padding_mask[fill]])
        self.cross[:, :src_len].copy_(kv)
        self.cross[:, src_len:bucket].zero_()
        mask = self.cross_mask.view(bsz, beam, -1)
        if padding_mask is None:
            mask[:, :, :src_len].fill_(False)
        else:
            mask[:, :, :src_len].copy_(padding_mask.unsqueeze(1))
        mask[:, :, src_len:].fill_(True)
        self.step.zero_()
        self.state.reset(bos)
        if real < bsz:
            self.state.finished[real:] = True
        self._restart_count()

    def _restart_count(self):
        """A new run of this workspace: no unfinished count read yet."""
        self.done_step = [-1, -1]
        self.previous_count = None

    def take_from(self, other: "_Workspace", sentences: Tensor, dummies: int, bucket: int,
                  capacity: int):
        """Continues ``other``'s decoding of ``sentences`` (see :meth:`BeamState.take_from`)."""
        rows = self.state.take_from(other.state, sentences, dummies)
        self._restart_count()
        self.cache(capacity).select_from(other.cache(capacity), rows)
        self.cross[:, :bucket].copy_(other.cross[:, :bucket].index_select(0, sentences))
        self.cross_mask.fill_(True)
        self.cross_mask[:, :bucket].copy_(other.cross_mask[:, :bucket].index_select(0, rows))


class LSSequenceGenerator(SequenceGenerator):
    """fairseq's ``SequenceGenerator`` (same constructor, same output); beam search over a single
    ls_transformer model runs with fixed shapes (see the module docstring)."""

    def __init__(self, models, tgt_dict, **kwargs):
        super().__init__(models, tgt_dict, **kwargs)
        # least recently used first; see _workspace for what is kept
        self._workspaces: "OrderedDict[Tuple[int, int], _Workspace]" = OrderedDict()
        self._told = set()
        self._stream = None  # the capture stream
        #: counts of the fixed-shape path: steps, graph replays, captures (and their host
        #: seconds), failed captures, shrinks
        self.stats = dict(steps=0, replays=0, captures=0, capture_s=0.0, capture_failures=0,
                          shrinks=0)
        path = mode()
        detail = ": CUDA graphs for fp16/bf16 models on a GPU, eager steps otherwise"
        logger.info(f"ls_fairseq decodes with LSSequenceGenerator "
                    f"({ENV}={path}{detail if path == 'graphs' else ''})")

    # ---- when the fixed-shape path applies ----------------------------------------------

    def unsupported(self, prefix_tokens=None, constraints=None) -> Optional[str]:
        """Why this call decodes with fairseq's own loop (None: it does not)."""
        if mode() == "fairseq":
            return f"{ENV}=fairseq"
        if self.model.models_size != 1:
            return "an ensemble of several models (--path a:b)"
        if not isinstance(self.model.single_model.decoder, LSTransformerDecoder):
            return "a model other than ls_transformer"
        if type(self.search) is not search.BeamSearch:
            return (f"the search strategy {type(self.search).__name__} (--sampling, "
                    "--diverse-beam-groups, --diversity-rate, --match-source-len, --constraints "
                    "or --prefix-allowed-tokens)")
        if self.match_source_len:
            return "--match-source-len"
        if self.repeat_ngram_blocker is not None:
            return "--no-repeat-ngram-size"
        if self.lm_model is not None:
            return "--lm-path"
        if self.token_indices_to_suppress is not None:
            return "tokens to suppress"
        if prefix_tokens is not None:
            return "--prefix-size"
        if constraints is not None:
            return "--constraints"
        return None

    def _generate(self, sample: Dict[str, Dict[str, Tensor]], prefix_tokens: Optional[Tensor] = None,
                  constraints: Optional[Tensor] = None, bos_token: Optional[int] = None):
        net_input = sample["net_input"]
        reason = self.unsupported(prefix_tokens, constraints)
        if reason is None and "src_tokens" not in net_input:
            reason = "a source other than src_tokens"
        if reason is not None:
            if reason not in self._told:
                self._told.add(reason)
                logger.info(f"ls_fairseq's fixed-shape beam search is off for {reason}: "
                            "fairseq's SequenceGenerator decodes")
            return super()._generate(sample, prefix_tokens, constraints, bos_token)
        return self._generate_fixed(net_input, self.eos if bos_token is None else bos_token)

    # ---- the fixed-shape path -----------------------------------------------------------

    def _generate_fixed(self, net_input, bos: int) -> List[List[Dict[str, Tensor]]]:
        src_tokens = net_input["src_tokens"]
        bsz, src_len = src_tokens.size()[:2]
        beam = self.beam_size
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, \
            "min_len cannot be larger than max_len, please adjust these!"
        model = self.model.single_model
        decoder: LSTransformerDecoder = model.decoder
        encoder_out = self.model.forward_encoder(net_input)[0]
        enc = encoder_out["encoder_out"][0]  # [S, bsz, C]
        padding = (encoder_out["encoder_padding_mask"][0]
                   if len(encoder_out["encoder_padding_mask"]) > 0 else None)
        attns = [layer.encoder_attn for layer in decoder.layers]
        kv = decoder.encoder_kv.project(enc.transpose(0, 1), attns)  # [bsz, S, 2L, H, D]

        # CUDA graphs for half-precision models (the kernels' dtypes); they need fixed shapes:
        # the source rounded up to a bucket, attention over a power-of-two capacity, unwritten
        # positions masked. Without graphs the steps attend over exactly the positions so far.
        graphs = (src_tokens.is_cuda and mode() == "graphs"
                  and kv.dtype in (torch.float16, torch.bfloat16))
        padded = graphs or PAD_EAGER
        bucket = _source_bucket(src_len) if padded else src_len
        width = max_len + 2
        ws = self._workspace(decoder, _batch_bucket(bsz) if padded else bsz, beam, bucket,
                             width, kv.dtype, src_tokens.device)
        ws.load(kv, padding, src_len, bucket, bos)

        capacity = min(INITIAL_CAPACITY, max_len + 1)
        ws.cache(capacity).reset()
        step_fn = self._step_function(model, ws, bucket, capacity, None if padded else 1)
        if graphs and max_len > 0:
            self._replay(ws, step_fn, bucket, capacity, first=True)
        else:
            step_fn(first=True, last=max_len == 0)
        sentences = list(range(bsz))  # the original index of each of ws's sentences
        out: List[Optional[List[Dict[str, Tensor]]]] = [None] * bsz
        for step in range(1, max_len + 1):
            unfinished = self._unfinished(ws, step, graphs)
            if unfinished == 0:
                break
            changed = False
            if unfinished <= ws.bsz // SHRINK and step < max_len:
                self.stats["shrinks"] += 1
                ws, sentences = self._shrink(ws, sentences, out, decoder, bucket, width,
                                             capacity)
                if ws is None:
                    break
                changed = True
            if step >= capacity:
                grown = min(2 * capacity, max_len + 1)
                ws.grow(capacity, grown)
                capacity, changed = grown, True
            if not padded:
                step_fn = self._step_function(model, ws, bucket, capacity, step + 1)
            elif changed:
                step_fn = self._step_function(model, ws, bucket, capacity)
            if step == max_len:
                step_fn(first=False, last=True)
            elif graphs:
                self._replay(ws, step_fn, bucket, capacity)
            else:
                step_fn(first=False, last=False)
        if ws is not None:
            for i, hypos in zip(sentences, ws.state.hypotheses(self.normalize_scores,
                                                               self.len_penalty)):
                out[i] = hypos
        return out

    def _shrink(self, ws: _Workspace, sentences: List[int], out, decoder, bucket: int,
                width: int, capacity: int):
        """fairseq's batch reduction, in powers of two: the finished sentences' hypotheses go to
        ``out``; the others continue in the workspace of the next power of two at or above their
        number (filled up with finished copies). Returns (workspace or None, its sentences)."""
        finished = ws.state.finished.tolist()[:len(sentences)]  # waits for the step in flight
        keep = [j for j, done in enumerate(finished) if not done]
        for j, hypos in enumerate(ws.state.hypotheses(self.normalize_scores, self.len_penalty)):
            if j < len(sentences) and finished[j]:
                out[sentences[j]] = hypos
        if not keep:
            return None, []
        size = 1 << (len(keep) - 1).bit_length()
        dummies = size - len(keep)
        index = torch.tensor(keep + [keep[0]] * dummies, device=ws.step.device)
        small = self._workspace(decoder, size, ws.beam, bucket, width, ws.dtype,
                                ws.step.device)
        small.take_from(ws, index, dummies, bucket, capacity)
        return small, [sentences[j] for j in keep]

    def _workspace(self, decoder, bsz, beam, bucket, width, dtype, device) -> _Workspace:
        """The workspace of (bsz, beam), made or grown to fit. Workspaces stay for later batches
        (their graphs too), least recently used first out once there are more than
        ``MAX_WORKSPACES`` or, on a GPU, their buffers pass ``WORKSPACE_MEMORY`` of its memory."""
        key = (bsz, beam)
        ws = self._workspaces.pop(key, None)
        if ws is None or not ws.fits(bucket, width, dtype) or ws.step.device != device:
            if ws is not None:  # grow past the largest shape so far
                bucket = max(bucket, ws.cross.size(1))
                width = max(width, ws.state.width)
                del ws
            ws = _Workspace(self, decoder, bsz, beam, bucket, width, dtype, device)
        self._workspaces[key] = ws
        budget = None
        if device.type == "cuda":
            budget = WORKSPACE_MEMORY * torch.cuda.get_device_properties(device).total_memory
        while len(self._workspaces) > 1 and (
                len(self._workspaces) > MAX_WORKSPACES or budget is not None
                and sum(w.nbytes() for w in self._workspaces.values()) > budget):
            self._workspaces.popitem(last=False)
        return ws

    def _step_function(self, model, ws: _Workspace, bucket: int, capacity: int,
                       length: Optional[int] = None):
        """The decoding step over the workspace's source ``bucket`` and self-attention
        ``capacity``, attending over its first ``length`` positions (default: all)."""
        decoder: LSTransformerDecoder = model.decoder
        cache = ws.cache(capacity, length)
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        decoder.set_incremental_state(incremental_state, "self_kv", {"cache": cache})
        decoder.set_incremental_state(incremental_state, "encoder_kv",
                                      {"kv": ws.cross[:, :bucket], "rows": ws.cross_rows})
        encoder_out = {"encoder_out": [ws.cross.new_empty(0)],
                       "encoder_padding_mask": [ws.cross_mask[:, :bucket]]}
        temperature = self.temperature
        state = ws.state

        def step(first: bool, last: bool):
            logits, _ = decoder(state.last_tokens(), encoder_out, incremental_state,
                                need_attn=False)
            if temperature != 1.0:
                logits.div_(temperature)
            lprobs = model.get_normalized_probs((logits, None), log_probs=True)[:, -1, :]
            order = state.advance(lprobs, first=first, last=last)
            cache.reorder(order)
            cache.advance()

        return step

    def _replay(self, ws: _Workspace, step_fn, bucket: int, capacity: int, first: bool = False):
        """Runs the step (``first``: step 0's) as the workspace's graph of this shape, captured
        the first time. A capture that fails is dropped: that shape's steps then run eagerly,
        with one log line."""
        self.stats["replays"] += 1
        key = (bucket, capacity, first)
        graph = ws.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if key in ws.uncapturable:
            step_fn(first=first, last=False)
            return
        t0 = time.perf_counter()
        current = torch.cuda.current_stream()
        warm_up = self._stream is None
        if warm_up:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(current)
        if warm_up:
            # the generator's first capture: this step runs eagerly on the capture stream first
            # (lazy kernel loading, library handles), and its replay is skipped
            with torch.cuda.stream(stream):
                step_fn(first=first, last=False)
        if ws.pool is None:
            ws.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            error = _capture(graph, ws.pool, lambda: step_fn(first=first, last=False))
            if error is not None and not warm_up:  # nothing of the step ran: run it now
                step_fn(first=first, last=False)
        current.wait_stream(stream)
        if error is not None:
            ws.uncapturable.add(key)
            self.stats["capture_failures"] += 1
            if "capture" not in self._told:
                self._told.add("capture")
                logger.warning(f"ls_fairseq: a decoding step could not be captured as a CUDA "
                               f"graph ({error}); steps of its shape run eagerly")
            return
        ws.graphs[key] = graph
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        if not warm_up:
            graph.replay()

    def _unfinished(self, ws: _Workspace, step: int, graphs: bool) -> int:
        """How many of the workspace's sentences were unfinished before ``step``; on a GPU, as of
        one step earlier (an upper bound: the flag is copied without waiting, and the step in
        flight is not waited for)."""
        count = (~ws.state.finished).sum()
        self.stats["steps"] += 1
        if not graphs:  # the same schedule, read synchronously
            previous, ws.previous_count = ws.previous_count, count
            return ws.bsz if previous is None else int(previous)
        if ws.done is None:
            ws.done = torch.zeros(2, dtype=torch.long, pin_memory=True)
            ws.events = [torch.cuda.Event(), torch.cuda.Event()]
        slot = step % 2
        ws.done[slot].copy_(count, non_blocking=True)
        ws.events[slot].record()
        ws.done_step[slot] = step
        if ws.done_step[1 - slot] != step - 1:  # nothing read yet for this workspace
            return ws.bsz
        ws.events[1 - slot].synchronize()
        return int(ws.done[1 - slot])
