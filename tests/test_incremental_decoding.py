"""Incremental decoding with the self-attention key/value cache (ls_fairseq/modules/kv_cache.py),
on the CPU in fp32.

* fairseq's SequenceGenerator with an ls_ model and fairseq's ``transformer`` holding the same
  weights: same hypotheses (tokens), scores within 1e-5 relative (beam 1 and 5, odd batches,
  padded sources, prefix tokens, ``match_source_len``, lengths that grow the cache twice);
* the same generation through the concatenating path (the cache's autograd mode, the code the
  cache replaced): identical tokens, scores and alignments, bit for bit;
* decoder steps with padding inside the decoder input (the key padding mask path) and beam
  reorders against fairseq and against the concatenating path;
* the cache itself against a list of concatenated tensors: growth, reorders that permute,
  duplicate and drop rows, steps of several positions; two buffers whose addresses stay fixed
  between growths; independent decoding runs.
"""
import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_helpers import TINY, build_pair, make_dictionary, max_rel_err, random_batch
from ls_fairseq.modules import SelfAttention, kv_cache
from ls_fairseq.modules.kv_cache import SelfAttentionKVCache

TOL = 1e-5
CONFIGS = {
    "post_ln_shared": ("transformer", TINY + ["--share-all-embeddings"]),
    "pre_ln_t2t": ("transformer_wmt_en_de_big_t2t", TINY + ["--share-all-embeddings"]),
    "learned_pos": ("transformer_wmt_en_de_big", TINY + [
        "--encoder-learned-pos", "--decoder-learned-pos", "--share-decoder-input-output-embed"]),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops: one thread is faster than a pool (much faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dictionary():
    return make_dictionary(45)


@pytest.fixture(scope="module")
def pairs(dictionary):
    """name -> (fairseq model, ls_ model), same perturbed weights, eval mode."""
    out = {}
    for name, (arch, extra) in CONFIGS.items():
        ref, ls = build_pair(arch, dictionary, extra, seed=11)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        ls.load_state_dict(ref.state_dict())
        out[name] = (ref.eval(), ls.eval())
    return out


@pytest.fixture
def caches(monkeypatch):
    """Every SelfAttentionKVCache made while the test runs."""
    made = []
    init = SelfAttentionKVCache.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SelfAttentionKVCache, "__init__", record)
    return made


def _concatenating(monkeypatch):
    """Routes every cache through its concatenating path (the code the buffers replaced)."""
    monkeypatch.setattr(SelfAttentionKVCache, "append",
                        lambda self, layer, kv, mask=None: self._append_concat(layer, kv, mask))


def _sample(dictionary, bsz, src_len, seed):
    g = torch.Generator().manual_seed(seed)
    src, src_lengths, _, _ = random_batch(dictionary, bsz, src_len, 1, g)
    return {"net_input": {"src_tokens": src, "src_lengths": src_lengths}}


def _generate(model, dictionary, sample, beam, prefix_tokens=None, **options):
    gen = SequenceGenerator([model], dictionary, beam_size=beam, **options)
    return gen.generate([model], sample, prefix_tokens=prefix_tokens)


def _close(a, b):
    return a == b or abs(a - b) <= TOL * abs(b)


def _assert_same_hypotheses(hyps, ref_hyps, exact=False):
    assert len(hyps) == len(ref_hyps)
    for sent, (mine, theirs) in enumerate(zip(hyps, ref_hyps)):
        assert len(mine) == len(theirs), sent
        for a, b in zip(mine, theirs):
            assert torch.equal(a["tokens"], b["tokens"]), (sent, a["tokens"], b["tokens"])
            if exact:
                assert torch.equal(a["score"], b["score"]), sent
                assert torch.equal(a["positional_scores"], b["positional_scores"]), sent
                assert torch.equal(a["alignment"], b["alignment"]), sent
                assert torch.equal(a["attention"], b["attention"]), sent
            else:
                # -inf: a hypothesis forced to end (match_source_len), in both
                assert _close(float(a["score"]), float(b["score"])), sent
                assert max_rel_err(a["positional_scores"], b["positional_scores"]) <= TOL, sent


GENERATIONS = {
    # beam, batch size, longest source, SequenceGenerator options, prefix length
    "greedy": (1, 5, 9, {"max_len_b": 30}, 0),
    "beam5": (5, 7, 11, {"max_len_b": 30}, 0),
    # min_len keeps every hypothesis >= 36 tokens: the cache grows 16 -> 32 -> 64 positions
    "beam5_long": (5, 3, 7, {"max_len_a": 0, "max_len_b": 44, "min_len": 36}, 0),
    "greedy_long": (1, 3, 7, {"max_len_b": 44, "min_len": 36}, 0),
    "beam5_prefix": (5, 5, 8, {"max_len_b": 25}, 3),
    "beam5_match_source_len": (5, 5, 12, {"match_source_len": True}, 0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("case", list(GENERATIONS))
def test_sequence_generator_matches_fairseq(name, case, pairs, dictionary, caches):
    beam, bsz, src_len, options, prefix_len = GENERATIONS[case]
    ref, ls = pairs[name]
    sample = _sample(dictionary, bsz, src_len, seed=len(case) + bsz)
    prefix = None
    if prefix_len:
        g = torch.Generator().manual_seed(2)
        prefix = torch.randint(dictionary.nspecial, len(dictionary), (bsz, prefix_len),
                               generator=g)
        prefix[1, -1] = dictionary.pad()  # a shorter prefix: that step is not forced
    ref_hyps = _generate(ref, dictionary, sample, beam, prefix, **options)
    hyps = _generate(ls, dictionary, sample, beam, prefix, **options)
    _assert_same_hypotheses(hyps, ref_hyps)
    assert len(caches) == 1 and caches[0].concat is None  # the decoder's one cache, buffered
    if "long" in case:
        assert caches[0].grows >= 2 and caches[0].capacity >= 64
    if prefix is not None:
        for sent, hyp in enumerate(hyps):
            forced = prefix[sent][prefix[sent].ne(dictionary.pad())]
            assert torch.equal(hyp[0]["tokens"][:len(forced)], forced)


@pytest.mark.parametrize("case", ["greedy", "beam5", "beam5_long", "beam5_prefix"])
def test_sequence_generator_matches_concatenating_path_bit_for_bit(case, pairs, dictionary,
                                                                   monkeypatch):
    beam, bsz, src_len, options, prefix_len = GENERATIONS[case]
    _, ls = pairs["pre_ln_t2t"]
    sample = _sample(dictionary, bsz, src_len, seed=3)
    prefix = None
    if prefix_len:
        prefix = torch.randint(dictionary.nspecial, len(dictionary), (bsz, prefix_len),
                               generator=torch.Generator().manual_seed(4))
    hyps = _generate(ls, dictionary, sample, beam, prefix, **options)
    with monkeypatch.context() as m:
        _concatenating(m)
        old = _generate(ls, dictionary, sample, beam, prefix, **options)
    _assert_same_hypotheses(hyps, old, exact=True)


def _decode_steps(model, enc, prev, reorders, state=None):
    """Decoder steps over ``prev`` with ``reorders`` {step: new_order} applied before a step:
    the logits of every step (``state``: the incremental state to start from)."""
    state, out = ({} if state is None else state), []
    for t in range(1, prev.size(1) + 1):
        if t in reorders:
            model.decoder.reorder_incremental_state_scripting(state, reorders[t])
            enc = model.encoder.reorder_encoder_out(enc, reorders[t])
            prev = prev.index_select(0, reorders[t])
        out.append(model.decoder(prev[:, :t], enc, incremental_state=state)[0])
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_decoder_input_and_reorders(name, pairs, dictionary, monkeypatch):
    """Padding inside the decoder input (fairseq then passes a key padding mask) from the third
    step on, over growths (capacity 2 -> 4 -> 8 -> 16) and beam search's reorders: 3 sentences x
    beam 2, beams permuted and duplicated within their sentence, then one sentence dropped."""
    monkeypatch.setattr(kv_cache, "INITIAL_CAPACITY", 2)
    ref, ls = pairs[name]
    g = torch.Generator().manual_seed(9)
    src, src_lengths, _, _ = random_batch(dictionary, 3, 7, 1, g)
    src, src_lengths = src.repeat_interleave(2, 0), src_lengths.repeat_interleave(2, 0)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (6, 11), generator=g)
    prev[:, 0] = dictionary.eos()
    prev[1, 2] = prev[4, 5] = prev[4, 6] = prev[0, 9] = dictionary.pad()
    reorders = {4: torch.tensor([1, 1, 2, 3, 5, 4]), 7: torch.tensor([1, 0, 4, 4]),
                9: torch.tensor([1, 1, 3, 2])}
    with torch.no_grad():
        ref_logits = _decode_steps(ref, ref.encoder(src, src_lengths), prev, reorders)
        logits = _decode_steps(ls, ls.encoder(src, src_lengths), prev, reorders)
        with monkeypatch.context() as m:
            _concatenating(m)
            old_logits = _decode_steps(ls, ls.encoder(src, src_lengths), prev, reorders)
    for t, (a, b, c) in enumerate(zip(logits, ref_logits, old_logits)):
        assert max_rel_err(a, b) <= TOL, t
        assert torch.equal(a, c), t


def test_decoding_runs_are_independent(pairs, dictionary):
    """Two runs of one model interleaved step by step (two generators' states) give what each
    gives alone: the cache lives in each run's incremental_state."""
    _, ls = pairs["post_ln_shared"]
    g = torch.Generator().manual_seed(1)
    runs = []
    with torch.no_grad():
        for bsz in (3, 5):
            src, src_lengths, prev, _ = random_batch(dictionary, bsz, 6, 20, g)
            prev[:, 1:] = torch.randint(dictionary.nspecial, len(dictionary), prev[:, 1:].shape,
                                        generator=g)
            runs.append((ls.encoder(src, src_lengths), prev))
        alone = [_decode_steps(ls, enc, prev, {}) for enc, prev in runs]
        states, together = [{}, {}], [[], []]
        for t in range(1, 21):
            for i, (enc, prev) in enumerate(runs):
                together[i].append(ls.decoder(prev[:, :t], enc, incremental_state=states[i])[0])
    for a, b in zip(alone, together):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- the cache itself


class _Concatenated:
    """The reference: per layer, keys/values/masks concatenated along the positions."""

    def __init__(self, layers):
        self.kv = [None] * layers
        self.mask = [None] * layers

    def append(self, layer, kv, mask):
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.kv[layer] is not None:
            n = self.kv[layer][0].size(2)
            k, v = (torch.cat([p, x], dim=2) for p, x in zip(self.kv[layer], (k, v)))
            if mask is not None or self.mask[layer] is not None:
                prev = self.mask[layer] if self.mask[layer] is not None else \
                    torch.zeros(k.size(0), n, dtype=torch.bool)
                step = mask if mask is not None else torch.zeros(k.size(0), kv.size(1),
                                                                 dtype=torch.bool)
                mask = torch.cat([prev, step], dim=1)
        self.kv[layer], self.mask[layer] = (k, v), mask
        return k, v, mask

    def reorder(self, order):
        self.kv = [None if s is None else tuple(t.index_select(0, order) for t in s)
                   for s in self.kv]
        self.mask = [None if m is None else m.index_select(0, order) for m in self.mask]


def test_cache_matches_concatenation():
    g = torch.Generator().manual_seed(0)
    layers, heads, dim = 3, 2, 5
    cache, ref = SelfAttentionKVCache(layers, capacity=3), _Concatenated(layers)
    rows = 6
    # (positions this step, layer given a mask or None, reorder after the step or None)
    plan = [(1, None, None), (2, None, torch.tensor([5, 4, 3, 2, 1, 0])), (1, 1, None),
            (1, None, torch.tensor([0, 0, 2, 3, 5])), (3, 2, None),
            (1, None, torch.tensor([4, 1, 3])), (1, 0, torch.tensor([2, 0, 1, 1, 0, 2, 2])),
            (5, None, None), (1, None, torch.tensor([6, 5]))]
    for steps, masked_layer, order in plan:
        for layer in range(layers):
            kv = torch.randn(rows, steps, 2, heads, dim, generator=g)
            mask = None
            if masked_layer == layer:
                mask = torch.rand(rows, steps, generator=g) < 0.5
            k, v, m = cache.append(layer, kv, mask)
            rk, rv, rm = ref.append(layer, kv, mask)
            assert torch.equal(k, rk) and torch.equal(v, rv)
            assert (m is None) == (rm is None) and (m is None or torch.equal(m, rm))
        if order is not None:
            cache.reorder(order)
            ref.reorder(order)
            rows = order.numel()
    assert cache.capacity == 24 and cache.grows == 3  # 3 -> 6 -> 12 -> 24 (16 positions)
    assert cache.masked == [True, True, True]


def test_buffers_keep_their_addresses_between_growths():
    """One write per layer and one gather per reorder, into two buffers that swap: between
    growths no allocation, so a captured step would read and write fixed addresses."""
    cache = SelfAttentionKVCache(2, capacity=8)
    order = torch.tensor([1, 0, 3, 2])
    addresses = []
    for step in range(14):
        for layer in range(2):
            k, v, mask = cache.append(layer, torch.randn(4, 1, 2, 3, 4))
            assert mask is None and k.shape == (4, 3, step + 1, 4)
            assert k.data_ptr() == cache.buffer[layer, 0].data_ptr()
        cache.reorder(order)
        addresses.append((cache.capacity, cache.buffer.data_ptr()))
    before, after = addresses[:8], addresses[8:]
    assert {c for c, _ in before} == {8} and {c for c, _ in after} == {16}
    assert len({a for _, a in before}) == 2 and len({a for _, a in after}) == 2
    assert [a for _, a in before[2:]] == [a for _, a in before[:-2]]  # they alternate


def test_autograd_through_decoding_concatenates():
    """With gradients, the cache concatenates (in-place writes would break backward); a run
    begun without gradients refuses a step that needs them."""
    attn = SelfAttention(8, 2)
    x = torch.randn(3, 4, 8, requires_grad=True)
    state = {}
    outs = [attn(x[:, t:t + 1], None, causal=True, incremental_state=state)[0] for t in range(4)]
    torch.cat(outs, dim=1).sum().backward()
    full, _ = attn(x.detach(), None, causal=True, need_weights=True)
    step_by_step = torch.cat([o.detach() for o in outs], dim=1)
    assert max_rel_err(step_by_step, full) <= TOL
    assert x.grad is not None and torch.isfinite(x.grad).all()

    state = {}
    with torch.no_grad():
        attn(x[:, :1], None, causal=True, incremental_state=state)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        attn(x[:, 1:2], None, causal=True, incremental_state=state)


def test_standalone_self_attention_keeps_and_reorders_its_own_cache():
    attn = SelfAttention(8, 2).eval()
    x = torch.randn(4, 6, 8)
    order = torch.tensor([2, 3, 0])
    with torch.no_grad():
        state = {}
        for t in range(3):
            attn(x[:, t:t + 1], None, causal=True, incremental_state=state)
        attn.reorder_incremental_state(state, order)
        last = attn(x[order, 3:4], None, causal=True, incremental_state=state)[0]
        full, _ = attn(x[order, :4], None, causal=True, need_weights=True)
    assert max_rel_err(last, full[:, 3:4]) <= TOL
    (entry,) = state.values()
    assert entry["cache"].rows == 3 and entry["cache"].lengths == [4]
