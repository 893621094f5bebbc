"""fairseq's beam search with fixed shapes: no batch shrinking, no host reads between steps.

fairseq's ``SequenceGenerator`` drops a sentence from the batch once it has ``beam`` finished
hypotheses, and its finalisation runs a Python loop over the finished hypotheses of each step
(``.tolist()``, ``.item()``): several host round trips per step, and a new shape whenever a sentence
finishes. :class:`BeamState` keeps every sentence in the batch until the end; a finished sentence
goes on decoding, but its hypotheses are no longer recorded, so the others see exactly what they
see in fairseq (every op of a step is row-wise). Finished hypotheses go to preallocated slots
(``beam`` per sentence, plus one discard slot), in fairseq's order, by index arithmetic on the
device. One step is a fixed sequence of tensor ops whose only per-step input, the step number,
lives in a device tensor: it can be captured once as a CUDA graph and replayed.

What a step computes, in fairseq's words (``sequence_generator.py`` and ``search.BeamSearch`` of
fairseq 0.12): NaN log-probabilities become -inf, ``pad`` is never chosen, ``--unkpen`` is
subtracted from ``unk``, only ``eos`` is allowed at ``max_len`` and ``eos`` is forbidden below
``--min-len``; the top ``2 * beam`` candidates over beam x vocabulary of the cumulative scores
(over the first beam only at step 0); candidates ending in ``eos`` among the first ``beam`` are
finalised (at most ``beam`` per sentence, in candidate order); the first ``beam`` candidates not
ending in ``eos`` continue. Scores are normalised by ``length ** --lenpen`` when the hypotheses
are read out (:meth:`BeamState.hypotheses`), with fairseq's op on the same device.
"""
import math
from typing import Dict, List

import torch
from torch import Tensor


class BeamState:
    """The search state of ``bsz`` sentences x ``beam`` hypotheses, hypotheses up to ``width - 2``
    tokens (``width`` >= ``max_len + 2``, as fairseq's ``tokens`` buffer), on ``device``.

    ``step`` is the device tensor holding the current step (shared with the decoder's
    :class:`~ls_fairseq.modules.kv_cache.StaticKVCache`)."""

    def __init__(self, bsz: int, beam: int, width: int, vocab: int, step: Tensor, *, pad: int,
                 unk: int, eos: int, min_len: int, unk_penalty: float):
        self.bsz, self.beam, self.width, self.vocab = bsz, beam, width, vocab
        self.pad, self.unk, self.eos = pad, unk, eos
        self.min_len, self.unk_penalty = min_len, unk_penalty
        self.step = step
        device = step.device
        rows = bsz * beam
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.full((rows, width), pad, **long)
        self.scores = torch.zeros(rows, width - 1, dtype=torch.float32, device=device)
        self.cands_to_ignore = torch.zeros(bsz, beam, dtype=torch.bool, device=device)
        self.finished = torch.zeros(bsz, dtype=torch.bool, device=device)
        self.fin_count = torch.zeros(bsz, **long)
        slots = bsz * (beam + 1)  # slot `beam` of each sentence: the discard slot
        self.fin_tokens = torch.full((slots, width), pad, **long)
        self.fin_cumulative = torch.zeros(slots, width - 1, dtype=torch.float32, device=device)
        self.fin_len = torch.zeros(slots, **long)
        self.bbsz_offsets = (torch.arange(bsz, **long) * beam).unsqueeze(1)
        self.slot_offsets = (torch.arange(bsz, **long) * (beam + 1)).unsqueeze(1)
        self.cand_offsets = torch.arange(2 * beam, **long)

    def reset(self, bos: int):
        self.tokens.fill_(self.pad)
        self.tokens[:, 0] = bos
        self.scores.zero_()
        self.cands_to_ignore.zero_()
        self.finished.zero_()
        self.fin_count.zero_()
        self.fin_len.zero_()

    def take_from(self, other: "BeamState", sentences: Tensor, dummies: int):
        """This state's sentences are ``other``'s ``sentences`` (fairseq's batch reduction, done
        rarely: a smaller state of fixed shape). The last ``dummies`` entries of ``sentences`` only
        fill the shape: they are marked finished and record nothing."""
        beam = self.beam
        rows = (sentences.unsqueeze(1) * beam + torch.arange(beam, device=sentences.device)).view(-1)
        slots = (sentences.unsqueeze(1) * (beam + 1)
                 + torch.arange(beam + 1, device=sentences.device)).view(-1)
        width = min(self.width, other.width)  # both hold max_len + 2 columns of this batch
        self.tokens.fill_(self.pad)
        self.tokens[:, :width].copy_(other.tokens[:, :width].index_select(0, rows))
        self.scores.zero_()
        self.scores[:, :width - 1].copy_(other.scores[:, :width - 1].index_select(0, rows))
        self.cands_to_ignore.copy_(other.cands_to_ignore.index_select(0, sentences))
        self.finished.copy_(other.finished.index_select(0, sentences))
        if dummies:
            self.finished[-dummies:] = True
        self.fin_count.copy_(other.fin_count.index_select(0, sentences))
        self.fin_tokens[:, :width].copy_(other.fin_tokens[:, :width].index_select(0, slots))
        self.fin_cumulative[:, :width - 1].copy_(
            other.fin_cumulative[:, :width - 1].index_select(0, slots))
        self.fin_len.copy_(other.fin_len.index_select(0, slots))
        return rows

    def last_tokens(self) -> Tensor:
        """The tokens the decoder reads at this step, [rows, 1]."""
        return self.tokens.index_select(1, self.step)

    def advance(self, lprobs: Tensor, first: bool = False, last: bool = False) -> Tensor:
        """One step of beam search from the decoder's log-probabilities ``lprobs`` [rows, V]
        (float32; modified in place). ``first``: step 0; ``last``: ``step == max_len``. Returns
        the order of the rows for the next step (fairseq's ``reorder_state``), [rows]."""
        bsz, beam, vocab = self.bsz, self.beam, self.vocab
        lprobs.masked_fill_(lprobs != lprobs, -math.inf)
        lprobs[:, self.pad] = -math.inf
        lprobs[:, self.unk] -= self.unk_penalty
        if last:
            lprobs[:, :self.eos] = -math.inf
            lprobs[:, self.eos + 1:] = -math.inf
        elif first:
            if self.min_len > 0:
                lprobs[:, self.eos] = -math.inf
        elif self.min_len > 1:  # eos forbidden while step < min_len
            lprobs[:, self.eos].masked_fill_(self.step < self.min_len, -math.inf)

        # search.BeamSearch.step
        lp = lprobs.view(bsz, beam, vocab)
        if first:
            lp = lp[:, ::beam, :].contiguous()
        else:
            lp = lp + self.scores.index_select(1, self.step - 1).view(bsz, beam, 1)
        flat = lp.view(bsz, -1)
        cand_scores, cand = torch.topk(flat, k=min(2 * beam, flat.size(1) - 1))
        cand_beams = torch.div(cand, vocab, rounding_mode="trunc")
        cand_indices = cand.fmod(vocab)
        cand_bbsz_idx = cand_beams + self.bbsz_offsets

        eos_mask = cand_indices.eq(self.eos) & cand_scores.ne(-math.inf)
        eos_mask[:, :beam] &= ~self.cands_to_ignore
        # a finished sentence has left fairseq's batch: it records nothing more
        self._finalize(eos_mask[:, :beam] & ~self.finished.unsqueeze(1),
                       cand_bbsz_idx[:, :beam], cand_scores[:, :beam], last)

        eos_mask[:, :beam] |= self.cands_to_ignore
        cand_size = 2 * beam
        active_mask = eos_mask.long() * cand_size + self.cand_offsets[:eos_mask.size(1)]
        new_cands_to_ignore, active_hypos = torch.topk(active_mask, k=beam, dim=1,
                                                        largest=False)
        self.cands_to_ignore.copy_(new_cands_to_ignore.ge(cand_size)[:, :beam])
        active_bbsz_idx = torch.gather(cand_bbsz_idx, 1, active_hypos).view(-1)
        # columns after the step are still pad / zero in every row: whole rows move
        self.tokens.copy_(self.tokens.index_select(0, active_bbsz_idx))
        self.tokens.index_copy_(1, self.step + 1,
                                torch.gather(cand_indices, 1, active_hypos).view(-1, 1))
        self.scores.copy_(self.scores.index_select(0, active_bbsz_idx))
        self.scores.index_copy_(1, self.step,
                                torch.gather(cand_scores, 1, active_hypos).view(-1, 1))
        return active_bbsz_idx

    def _finalize(self, new_eos: Tensor, bbsz_idx: Tensor, eos_scores: Tensor, last: bool):
        """fairseq's ``finalize_hypos`` for the candidates in ``new_eos`` [bsz, beam]: the first
        ``beam - found`` of each sentence, in candidate order, to the sentence's next slots."""
        beam = self.beam
        slot = self.fin_count.unsqueeze(1) + new_eos.long().cumsum(1) - 1
        take = new_eos & slot.lt(beam)
        dest = (self.slot_offsets + torch.where(take, slot, torch.full_like(slot, beam))).view(-1)
        src = bbsz_idx.reshape(-1)
        rows = self.tokens.index_select(0, src)
        rows.index_fill_(1, self.step + 1, self.eos)
        self.fin_tokens.index_copy_(0, dest, rows)
        cumulative = self.scores.index_select(0, src)
        cumulative.index_copy_(1, self.step, eos_scores.reshape(-1, 1))
        self.fin_cumulative.index_copy_(0, dest, cumulative)
        self.fin_len.index_copy_(0, dest, (self.step + 1).expand(dest.numel()))
        self.fin_count.add_(take.sum(1))
        if last:
            self.finished.fill_(True)
        else:
            self.finished |= self.fin_count.eq(beam)

    def hypotheses(self, normalize_scores: bool, len_penalty: float
                   ) -> List[List[Dict[str, Tensor]]]:
        """The finished hypotheses of every sentence, best first: fairseq's output (``tokens``,
        ``score``, ``positional_scores`` on the device; ``attention`` and ``alignment`` empty)."""
        beam = self.beam
        counts = self.fin_count.tolist()
        lengths = self.fin_len.tolist()
        eos_scores = self.fin_cumulative.gather(
            1, (self.fin_len - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        if normalize_scores:
            # fairseq divides a step's eos scores by the Python float length ** len_penalty; the
            # same op (a tensor by a Python float) per length, selected on the device
            found = {lengths[i] for s, count in enumerate(counts)
                     for i in range(s * (beam + 1), s * (beam + 1) + count)}
            for length in sorted(found):
                eos_scores = torch.where(self.fin_len == length,
                                         eos_scores / length ** len_penalty, eos_scores)
        positional = self.fin_cumulative.clone()
        positional[:, 1:] = self.fin_cumulative[:, 1:] - self.fin_cumulative[:, :-1]
        tokens = self.fin_tokens.clone()  # the next batch reuses the buffers
        host_scores = eos_scores.tolist()
        # one C++ call each for the per-slot views (Python slicing of 3 tensors per hypothesis
        # costs more than the decoding of a short batch)
        token_rows, positional_rows = tokens.unbind(0), positional.unbind(0)
        score_items = eos_scores.unbind(0)
        empty = torch.empty(0)  # fairseq's attention/alignment of every hypothesis: nothing
        out: List[List[Dict[str, Tensor]]] = []
        for s, count in enumerate(counts):
            first = s * (beam + 1)
            hypos = []
            for i in range(first, first + count):
                n = lengths[i]
                hypos.append({
                    "tokens": token_rows[i][1:n + 1],
                    "score": score_items[i],
                    "attention": empty,
                    "alignment": empty,
                    "positional_scores": positional_rows[i][:n],
                })
            # fairseq's sort (torch.sort of the float scores, descending)
            order = torch.sort(torch.tensor(host_scores[first:first + count]), descending=True)[1]
            out.append([hypos[k] for k in order.tolist()])
        return out
