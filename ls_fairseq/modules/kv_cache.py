"""Self-attention keys and values of incremental decoding, in preallocated buffers.

One buffer holds the keys and values of every decoder layer, ``[layers, 2, rows, heads, capacity,
head_dim]`` (keys at index 0 of dim 1, values at 1). A decoding step writes its keys/values at the
layer's next positions in place (no concatenation) and attends over views of the filled positions,
``[rows, heads, length, head_dim]``, whose rows and heads fold into one batch dimension (a strided
batched GEMM reads them in place, as it read the contiguous concatenation). Beam search reorders
the filled positions of all layers with one gather into a second buffer of the same shape, and the
two swap roles. A step that would pass the capacity doubles it (the buffers are reallocated, the
filled positions copied): there is no length cap, the generator's ``--max-len-a/--max-len-b`` and
the model's positions decide.

Nothing here reads device memory from the host: positions and lengths are Python ints, and between
two growths the keys/values live in the same two buffers, as capturing a decoder step in a CUDA
graph needs.

Key padding masks, which fairseq passes only when a decoder input holds padding, are kept the same
way in a ``[layers, rows, capacity]`` buffer made when a layer first receives one. From then on
that layer attends with the mask of all its positions, False where no mask was given, as
fairseq's ``MultiheadAttention`` does (``_append_prev_key_padding_mask``).

Under autograd (grad enabled and keys/values that require it) the cache concatenates instead:
in-place writes into a buffer would invalidate the views that earlier steps saved for backward.

The cache belongs to one decoding run (it lives in fairseq's ``incremental_state``), so
generators and models in one process are independent.

:class:`StaticKVCache` is the fixed-shape variant for a decoder step captured as a CUDA graph
(``ls_fairseq.generation``): a fixed capacity, the step to write held in a device tensor, and
attention over every position with the unwritten ones masked, so no shape or host value changes
from one step to the next. Its beam reorder moves no keys/values: each position stays in the row
that wrote it, and a row table (``[rows, capacity]``) says, for every row and position, which
buffer row holds it (``ops.decode_attention`` reads through it).
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

#: positions allocated at the first step; each growth doubles the capacity
INITIAL_CAPACITY = 16


class LayerKVCache:
    """One layer's view of a :class:`SelfAttentionKVCache` or :class:`StaticKVCache`, handed to
    that layer's attention."""

    __slots__ = ("cache", "index")

    def __init__(self, cache, index: int):
        self.cache = cache
        self.index = index

    def append(self, kv: Tensor, key_padding_mask: Optional[Tensor] = None):
        """See :meth:`SelfAttentionKVCache.append` / :meth:`StaticKVCache.append`."""
        return self.cache.append(self.index, kv, key_padding_mask)

    @property
    def row_table(self) -> Optional[Tensor]:
        """Where each row's keys/values are (:attr:`StaticKVCache.row_table`); None: in the row
        itself."""
        return self.cache.row_table


class SelfAttentionKVCache:
    """Self-attention keys/values (and key padding masks) of ``num_layers`` layers for one
    incremental decoding run. Allocated at the first :meth:`append`, from its keys/values'
    shape, dtype and device; ``capacity``: the positions allocated then (``INITIAL_CAPACITY``)."""

    #: keys/values stay in their rows (a reorder gathers them)
    row_table = None

    def __init__(self, num_layers: int, capacity: Optional[int] = None):
        capacity = INITIAL_CAPACITY if capacity is None else capacity
        if num_layers < 1 or capacity < 1:
            raise ValueError(f"SelfAttentionKVCache needs num_layers >= 1 and capacity >= 1, got "
                             f"{num_layers} and {capacity}")
        self.num_layers = num_layers
        self.capacity = capacity
        self.rows = 0  # the decoding batch: a prefix of the buffers' rows
        self.lengths = [0] * num_layers  # positions written, per layer
        self.grows = 0
        self.buffer: Optional[Tensor] = None  # [L, 2, R, H, capacity, D]
        self.spare: Optional[Tensor] = None  # the reorder's target, then swapped in
        self.mask: Optional[Tensor] = None  # [L, R, capacity], from a layer's first mask on
        self.spare_mask: Optional[Tensor] = None
        self.masked = [False] * num_layers
        # autograd mode: per layer (keys, values, mask), concatenated every step
        self.concat: Optional[List[Optional[Tuple[Tensor, Tensor, Optional[Tensor]]]]] = None
        self.layers = [LayerKVCache(self, i) for i in range(num_layers)]

    def positions(self, padding_idx: int) -> Optional[Tensor]:
        """None: the embedding numbers the positions from the decoder input's length."""
        return None

    def begin_step(self, tokens: Tensor, padding_idx: int) -> Optional[Tensor]:
        """The self-attention padding mask of this step's tokens (``[rows, 1]``): None unless one
        of them is padding, as fairseq passes it (this reads the tokens back to the host)."""
        mask = tokens.eq(padding_idx)
        return mask if mask.any() else None

    def append(self, layer: int, kv: Tensor, key_padding_mask: Optional[Tensor] = None):
        """Adds one step of ``layer``: ``kv`` [B, T, 2, H, D] (keys at index 0 of dim 2, the
        layout of a fused QKV projection's last two thirds), ``key_padding_mask`` [B, T] or None.
        Returns ``(k, v, mask)``: keys and values of every position so far, [B, H, length, D]
        views, and the mask [B, length] to attend with (None while the layer never had one)."""
        buffer = self.buffer
        if buffer is None or (kv.requires_grad and torch.is_grad_enabled()):
            return self._append_first_or_autograd(layer, kv, key_padding_mask)
        rows, steps = kv.shape[:2]
        if rows != self.rows:
            raise ValueError(f"decoding step of {rows} rows for a cache of {self.rows} (a batch "
                             "change goes through reorder_incremental_state)")
        start = self.lengths[layer]
        end = start + steps
        if end > self.capacity:
            self._grow(end)
            buffer = self.buffer
        slot = buffer[layer] if rows == buffer.size(2) else buffer[layer, :, :rows]
        slot.narrow(3, start, steps).copy_(kv.permute(2, 0, 3, 1, 4))  # slot [2, B, H, cap, D]
        self.lengths[layer] = end
        k, v = slot.narrow(3, 0, end).unbind(0)
        if key_padding_mask is None and self.mask is None:
            return k, v, None
        return k, v, self._append_mask(layer, key_padding_mask, start, end)

    def _append_first_or_autograd(self, layer: int, kv: Tensor,
                                  key_padding_mask: Optional[Tensor]):
        grad = kv.requires_grad and torch.is_grad_enabled()
        if self.buffer is None and (self.concat is not None or grad):
            return self._append_concat(layer, kv, key_padding_mask)
        if grad:
            raise RuntimeError(
                "ls_fairseq's decoding cache writes keys/values in place, which autograd cannot "
                "differentiate through; this run began without gradients, so keep it so "
                "(decode under torch.no_grad(), as fairseq's SequenceGenerator does)")
        self._allocate(kv.size(0), kv)
        return self.append(layer, kv, key_padding_mask)

    def reorder(self, new_order: Tensor):
        """Row ``i`` becomes row ``new_order[i]`` (beam search's reorder; a shorter
        ``new_order`` drops finished sentences): one gather of every layer's filled positions."""
        if self.concat is not None:
            self.concat = [None if s is None else tuple(
                None if t is None else t.index_select(0, new_order) for t in s)
                for s in self.concat]
            return
        rows = new_order.size(0)
        if self.buffer is None:
            return
        filled = max(self.lengths)
        if self.spare is None or self.spare.size(2) < rows:
            shape = self.buffer.shape
            self.spare = self.buffer.new_empty(shape[:2] + (rows,) + shape[3:])
        torch.index_select(self.buffer[:, :, :self.rows, :, :filled], 2, new_order,
                           out=self.spare[:, :, :rows, :, :filled])
        self.buffer, self.spare = self.spare, self.buffer
        if self.mask is not None:
            if self.spare_mask is None or self.spare_mask.size(1) < rows:
                self.spare_mask = self.mask.new_zeros(
                    (self.num_layers, rows, self.mask.size(2)))
            torch.index_select(self.mask[:, :self.rows, :filled], 1, new_order,
                               out=self.spare_mask[:, :rows, :filled])
            self.mask, self.spare_mask = self.spare_mask, self.mask
        self.rows = rows

    def _allocate(self, rows: int, kv: Tensor):
        _, _, _, heads, head_dim = kv.shape
        self.rows = rows
        self.buffer = kv.new_empty((self.num_layers, 2, rows, heads, self.capacity, head_dim))

    def _grow(self, end: int):
        """Capacity x2 (or ``end`` if more), keeping the filled positions of the live rows."""
        capacity = max(end, 2 * self.capacity)
        filled = max(self.lengths)
        old = self.buffer
        # rows dropped by earlier reorders (finished sentences) are not carried over
        self.buffer = old.new_empty(old.shape[:2] + (self.rows, old.size(3), capacity, old.size(5)))
        self.buffer[:, :, :self.rows, :, :filled].copy_(old[:, :, :self.rows, :, :filled])
        self.spare = None  # reallocated at the next reorder, at the new capacity
        if self.mask is not None:
            old_mask = self.mask
            self.mask = old_mask.new_zeros((self.num_layers, self.rows, capacity))
            self.mask[:, :self.rows, :filled].copy_(old_mask[:, :self.rows, :filled])
            self.spare_mask = None
        self.capacity = capacity
        self.grows += 1

    def _append_mask(self, layer: int, key_padding_mask: Optional[Tensor], start: int, end: int):
        if self.mask is None:  # positions before the first mask are not padding
            self.mask = key_padding_mask.new_zeros(
                (self.num_layers, self.buffer.size(2), self.capacity))
        slot = self.mask[layer, :self.rows]
        if key_padding_mask is None:
            slot[:, start:end].zero_()
        else:
            slot[:, start:end].copy_(key_padding_mask)
            self.masked[layer] = True
        return slot[:, :end] if self.masked[layer] else None

    def _append_concat(self, layer: int, kv: Tensor, key_padding_mask: Optional[Tensor]):
        """Autograd mode: concatenation along the positions, fairseq's way."""
        if self.concat is None:
            self.concat = [None] * self.num_layers
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        saved = self.concat[layer]
        if saved is not None:
            prev_k, prev_v, prev_mask = saved
            k = torch.cat([prev_k, k], dim=2)
            v = torch.cat([prev_v, v], dim=2)
            if prev_mask is not None or key_padding_mask is not None:
                bsz, steps = kv.size(0), kv.size(1)
                if prev_mask is None:
                    prev_mask = key_padding_mask.new_zeros(bsz, k.size(2) - steps)
                if key_padding_mask is None:
                    key_padding_mask = prev_mask.new_zeros(bsz, steps)
                key_padding_mask = torch.cat([prev_mask, key_padding_mask], dim=1)
        self.concat[layer] = (k, v, key_padding_mask)
        self.lengths[layer] = k.size(2)
        return k, v, key_padding_mask


class StaticKVCache:
    """Self-attention keys/values of ``num_layers`` layers in fixed-shape buffers: ``buffer``
    ``[layers, 2, rows, heads, capacity, head_dim]``, ``mask`` ``[rows, capacity]`` (True where a
    position is padding or not written yet), ``row_table`` ``[rows, capacity]`` int64 (row ``r``'s
    keys/values at position ``t`` are in buffer row ``row_table[r, t]``) and ``step``, a
    one-element device tensor: the position the next decoding step writes.

    A step writes row ``r``'s keys/values at ``(r, step)`` and never moves them: beam search's
    reorder permutes the rows of ``row_table`` and ``mask`` only ([rows, capacity] integers instead
    of every layer's keys/values). Every method keeps shapes and reads nothing back to the host, so
    a decoding step that uses it can be captured once and replayed for every step below
    ``capacity``. ``buffer``, ``mask`` and ``row_table`` may be views of larger tensors (a
    workspace reused across batches); without ``row_table`` the cache makes its own."""

    def __init__(self, buffer: Tensor, mask: Tensor, step: Tensor,
                 row_table: Optional[Tensor] = None):
        if buffer.dim() != 6 or buffer.size(1) != 2 or mask.shape != (buffer.size(2), buffer.size(4)):
            raise ValueError(f"StaticKVCache needs buffer [L, 2, R, H, C, D] and mask [R, C], got "
                             f"{tuple(buffer.shape)} and {tuple(mask.shape)}")
        if row_table is not None and (row_table.shape != mask.shape
                                      or row_table.dtype != torch.long):
            raise ValueError(f"StaticKVCache needs row_table [R, C] = {tuple(mask.shape)} int64, "
                             f"got {tuple(row_table.shape)} {row_table.dtype}")
        self.buffer = buffer
        self.mask = mask
        self.row_table = row_table
        self.step = step
        self.num_layers = buffer.size(0)
        self.rows = buffer.size(2)
        self.capacity = buffer.size(4)
        self.layers = [LayerKVCache(self, i) for i in range(self.num_layers)]
        if row_table is None:
            self.row_table = self._row_ids().repeat(1, self.capacity)

    def _row_ids(self) -> Tensor:
        """[R, 1]: each row's own index. Made by the call that uses it: a CUDA graph captured
        over a method must not read a tensor that this (short-lived) object owns."""
        return torch.arange(self.rows, device=self.mask.device).unsqueeze(1)

    def reset(self):
        """Empty: every position masked and in its own row, step 0."""
        self.mask.fill_(True)
        self.row_table.copy_(self._row_ids().expand_as(self.row_table))
        self.step.zero_()

    def positions(self, padding_idx: int) -> Tensor:
        """The positions of this step's tokens, ``[rows, 1]``: fairseq's ``padding_idx + 1 + step``
        (the token at ``step`` has ``step`` tokens before it)."""
        return (self.step + (padding_idx + 1)).repeat(self.rows).view(self.rows, 1)

    def begin_step(self, tokens: Tensor, padding_idx: int) -> Tensor:
        """Records which of this step's tokens (``[rows, 1]``) are padding, and that each row
        writes its own keys/values at ``step``; returns the mask every layer attends with,
        ``[rows, capacity]``."""
        self.mask.index_copy_(1, self.step, tokens.eq(padding_idx))
        self.row_table.index_copy_(1, self.step, self._row_ids())
        return self.mask

    def append(self, layer: int, kv: Tensor, key_padding_mask: Optional[Tensor] = None):
        """Writes one step of ``layer``, ``kv`` [rows, 1, 2, H, D], at ``step``; returns ``(k, v,
        mask)``: keys and values of every position, [rows, H, capacity, D] views of the buffer to
        read through :attr:`row_table`, and the mask (this step's padding came through
        :meth:`begin_step`; ``key_padding_mask`` is unused)."""
        slot = self.buffer[layer]  # [2, R, H, C, D]
        slot.index_copy_(3, self.step, kv.permute(2, 0, 3, 1, 4))
        k, v = slot.unbind(0)
        return k, v, self.mask

    def reorder(self, new_order: Tensor):
        """Row ``i`` becomes row ``new_order[i]`` (``rows`` entries: the batch never shrinks): its
        table and mask rows; the keys/values stay where they are."""
        self.row_table.copy_(self.row_table.index_select(0, new_order))
        self.mask.copy_(self.mask.index_select(0, new_order))

    def advance(self):
        self.step.add_(1)

    def copy_from(self, other: "StaticKVCache"):
        """Takes ``other``'s positions and step (a smaller capacity: the step outgrew it)."""
        if other.capacity > self.capacity or other.rows != self.rows:
            raise ValueError("StaticKVCache.copy_from needs a cache of the same rows and no larger "
                             "capacity")
        c = other.capacity
        self.buffer[:, :, :, :, :c].copy_(other.buffer)
        self.mask[:, :c].copy_(other.mask)
        self.mask[:, c:].fill_(True)
        self.row_table[:, :c].copy_(other.row_table)
        self.row_table[:, c:].copy_(self._row_ids().expand(-1, self.capacity - c))
        self.step.copy_(other.step)

    def select_from(self, other: "StaticKVCache", order: Tensor):
        """Row ``i`` continues ``other``'s row ``order[i]`` (a batch that shrank: ``other`` has
        more rows, the same capacity): its keys/values are gathered through ``other``'s table
        into row ``i``, whose table is then its own row again."""
        if other.capacity != self.capacity or order.shape != (self.rows,):
            raise ValueError("StaticKVCache.select_from needs a cache of the same capacity and "
                             "one row of it per row")
        sources = other.row_table.index_select(0, order)  # [R, C]
        positions = torch.arange(self.capacity, device=order.device)
        # advanced indices on dims 2 and 4 come first: [R, C, L, 2, H, D]
        self.buffer.copy_(other.buffer[:, :, sources, :, positions].permute(2, 3, 0, 4, 1, 5))
        self.mask.copy_(other.mask.index_select(0, order))
        self.row_table.copy_(self._row_ids().expand_as(self.row_table))
        self.step.copy_(other.step)
