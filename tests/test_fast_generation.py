"""The fixed-shape beam search of ls_fairseq/generation/ (``LSSequenceGenerator``) on the CPU in
fp32, where it runs eagerly (no CUDA graphs): the same search as fairseq 0.12's
``SequenceGenerator._generate`` + ``search.BeamSearch``, with the same output.

* against fairseq's ``SequenceGenerator`` running fairseq's ``transformer`` with the same weights
  (3 architectures, each with its own weights and with an eos-biased variant whose hypotheses end
  at different steps; the eager steps with the CPU's exact shapes and with the CUDA graphs'
  padded ones): greedy, beam 2..5, batches of 1 to 7, lenpen 0.6/1.4, unkpen 0.5/-3,
  unnormalised scores, ``min_len`` forcing long outputs (the self-attention capacity grows
  16 -> 32 -> 45), ``max_len_a``/``max_len_b``, the constructor's ``max_len``, ``max_len``
  0/1/2, temperature, ``bos_token``, heavily padded sources. Same number of hypotheses per
  sentence, same order, identical tokens; scores and positional scores within 1e-5 relative
  (``TOL`` of tests/test_incremental_decoding.py): the two models are different fp32
  implementations (fused QKV, a fused cross-attention projection, masked attention over a padded
  capacity), so their log-probabilities differ in the last bits; a larger error, or one flipped
  choice, is a bug;
* eos-biased models whose sentences end early and at different steps (finalisation in
  fairseq's slot order, finished sentences going on in the fixed batch and recording nothing):
  also against the same ls_ model under fairseq's own loop; the fixed path stops where fairseq
  stops (at most one step later, plus one per batch reduction: it reads the count of unfinished
  sentences one step late, as on the GPU);
* fairseq's batch reduction, in powers of two (9 -> 4 -> 2 -> 1 with finished copies filling a
  batch, all sentences finished at a reduction), and the reduced workspaces reused afterwards;
* the fallbacks to fairseq's loop (prefix tokens, ``match_source_len``, ``no_repeat_ngram_size``,
  sampling, tokens to suppress, an ensemble, a non-ls model, ``LS_FAIRSEQ_GENERATOR=fairseq``):
  the result of fairseq's ``SequenceGenerator`` on the same model(s) bit for bit (the same code
  runs), one log line per reason, the fixed path not run; ``eager`` and a bad value of
  ``LS_FAIRSEQ_GENERATOR``;
* one generator over several batches: the workspace is regrown and reused, each result equals
  a fresh generator's bit for bit (the same ops on the same values), and a batch's results stay
  as they were while later batches decode (fairseq-interactive keeps them);
* patch 5 (``FairseqTask.build_generator``) picks the generator class;
* ``StaticKVCache`` on its own: writes at the device-held step, positions, the padding mask,
  reorders, ``copy_from``, bad shapes.

Under beam search ``cands_to_ignore`` stays all False (each beam row offers at most one eos
candidate, so at most ``beam`` of the ``2 * beam`` candidates end in eos): no test can see it.
"""
import argparse
import logging

import pytest
import torch
from fairseq import search
from fairseq.sequence_generator import SequenceGenerator, SequenceGeneratorWithAlignment
from fairseq.sequence_scorer import SequenceScorer
from fairseq.tasks.fairseq_task import FairseqTask
from fairseq.tasks.translation import TranslationTask

from fairseq_helpers import DummyTask, build_pair, make_dictionary
from ls_fairseq import fairseq_patches
from ls_fairseq.generation import LSSequenceGenerator, generator as generator_module
from ls_fairseq.generation.beam_search import BeamState
from ls_fairseq.modules.kv_cache import StaticKVCache
from test_incremental_decoding import CONFIGS, _assert_same_hypotheses, _decode_steps, _sample, one_thread  # noqa: F401 (autouse fixture)

ENV = generator_module.ENV
LOGGER = generator_module.logger.name

#: the decoder-output unit that carries the eos bias (see :func:`_bias_eos`)
BIAS_UNIT = 5
#: eos logit biases, per architecture, chosen so that (sample seed 3, 7 sentences, max_len 30):
#: beam search ends some sentences within 6 steps while others run to 20+ (MIXED), greedy does
#: the same (MIXED_GREEDY), every sentence of a beam search ends within 6 steps (EARLY)
MIXED = {"post_ln_shared": 2.5, "pre_ln_t2t": 1.25, "learned_pos": 1.25}
MIXED_GREEDY = {"post_ln_shared": 3.0, "pre_ln_t2t": 2.5, "learned_pos": 1.75}
EARLY = {"post_ln_shared": 3.0, "pre_ln_t2t": 2.75, "learned_pos": 2.5}


@pytest.fixture(autouse=True)
def default_mode(monkeypatch):
    """Every test starts from the default mode, whatever the environment says."""
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture(scope="module")
def dictionary():
    return make_dictionary(45)


def _bias_eos(model, bias, dictionary):
    """Every eos logit of ``model`` raised by exactly ``bias``: unit ``BIAS_UNIT`` of the
    decoder's output is made a constant 1 (weight 0, bias 1 in the last layer norm) and the
    output projection reads it for eos only, with weight ``bias``."""
    dec = model.decoder
    norm = dec.layer_norm if dec.layer_norm is not None else dec.layers[-1].final_layer_norm
    norm.weight[BIAS_UNIT] = 0
    norm.bias[BIAS_UNIT] = 1
    weight = dec.output_projection.weight  # tied to the embeddings in every config: both models
    weight[:, BIAS_UNIT] = 0               # get the same state anyway
    weight[dictionary.eos(), BIAS_UNIT] = bias


@pytest.fixture(scope="module")
def models(dictionary):
    """models(config, eos_bias=None) -> (fairseq model, ls_ model), same perturbed weights
    (those of tests/test_incremental_decoding.py), eval mode; built once per argument."""
    built = {}

    def get(name, bias=None):
        if (name, bias) not in built:
            arch, extra = CONFIGS[name]
            ref, ls = build_pair(arch, dictionary, extra, seed=11)
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in ref.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
                if bias is not None:
                    _bias_eos(ref, bias, dictionary)
            ls.load_state_dict(ref.state_dict())
            built[name, bias] = (ref.eval(), ls.eval())
        return built[name, bias]

    return get


class _Spy:
    """What the fixed-shape path did while a test ran."""

    def __init__(self):
        self.results = []     # what each _generate_fixed call returned
        self.steps = []       # BeamState.advance calls, per _generate_fixed call
        self.capacities = []  # self-attention capacities used, per _generate_fixed call
        self.shrinks = []     # batch reductions, per _generate_fixed call: (sentences before,
        #                       after (None: all had finished), kept)

    def assert_stopped(self, call, hyps):
        """The fixed path stopped where fairseq stops, at the step that ends the longest
        hypothesis, give or take the steps it decodes before it reads that all sentences
        finished: one, as on the GPU (the count is read one step late), and one more after each
        batch reduction."""
        longest = max(len(h["tokens"]) for sent in hyps for h in sent)
        late = 1 + len(self.shrinks[call])
        assert longest <= self.steps[call] <= longest + late, (self.steps[call], longest, late)


@pytest.fixture
def fixed(monkeypatch):
    spy = _Spy()
    generate_fixed = LSSequenceGenerator._generate_fixed
    step_function = LSSequenceGenerator._step_function
    advance = BeamState.advance
    shrink = LSSequenceGenerator._shrink

    def spy_generate_fixed(self, *args, **kwargs):
        spy.steps.append(0)
        spy.capacities.append([])
        spy.shrinks.append([])
        out = generate_fixed(self, *args, **kwargs)
        spy.results.append(out)
        return out

    def spy_step_function(self, model, ws, bucket, capacity, *args, **kwargs):
        if capacity not in spy.capacities[-1]:  # (made again for a step, a batch reduction)
            spy.capacities[-1].append(capacity)
        return step_function(self, model, ws, bucket, capacity, *args, **kwargs)

    def spy_advance(self, *args, **kwargs):
        spy.steps[-1] += 1
        return advance(self, *args, **kwargs)

    def spy_shrink(self, ws, sentences, *args, **kwargs):
        small, kept = shrink(self, ws, sentences, *args, **kwargs)
        spy.shrinks[-1].append((ws.bsz, None if small is None else small.bsz, len(kept)))
        return small, kept

    monkeypatch.setattr(LSSequenceGenerator, "_generate_fixed", spy_generate_fixed)
    monkeypatch.setattr(LSSequenceGenerator, "_shrink", spy_shrink)
    monkeypatch.setattr(LSSequenceGenerator, "_step_function", spy_step_function)
    monkeypatch.setattr(BeamState, "advance", spy_advance)
    return spy


def _padded_sample(dictionary, lengths, src_len, seed):
    """Left-padded sources of the given lengths (fairseq's default padding side)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), src_len), dictionary.pad(), dtype=torch.long)
    for i, n in enumerate(lengths):
        s = torch.randint(dictionary.nspecial, len(dictionary), (n,), generator=g)
        s[-1] = dictionary.eos()
        src[i, src_len - n:] = s
    return {"net_input": {"src_tokens": src, "src_lengths": torch.tensor(lengths)}}


def _assert_identical(hyps, ref_hyps):
    """Same hypotheses, tokens and scores bit for bit (attention not compared: the fixed path
    returns none)."""
    assert len(hyps) == len(ref_hyps)
    for sent, (mine, theirs) in enumerate(zip(hyps, ref_hyps)):
        assert len(mine) == len(theirs), sent
        for a, b in zip(mine, theirs):
            assert torch.equal(a["tokens"], b["tokens"]), (sent, a["tokens"], b["tokens"])
            assert torch.equal(a["score"], b["score"]), sent
            assert torch.equal(a["positional_scores"], b["positional_scores"]), sent


def _snapshot(hyps):
    return [[{k: h[k].clone() for k in ("tokens", "score", "positional_scores")} for h in sent]
            for sent in hyps]


def _lengths(hyps):
    return [[len(h["tokens"]) for h in sent] for sent in hyps]


# ------------------------------------------------------------ the fixed path against fairseq

# beam, sentences, longest source, SequenceGenerator options; "padded": source lengths instead
# of random ones, "bos": bos_token passed to generate
GENERATIONS = {
    "greedy": dict(beam=1, bsz=5, src=9, opts={"max_len_b": 30}),
    "beam5": dict(beam=5, bsz=7, src=11, opts={"max_len_b": 30}),
    "beam2_bsz1": dict(beam=2, bsz=1, src=10, opts={"max_len_b": 30}),
    "beam4_bsz7": dict(beam=4, bsz=7, src=8, opts={"max_len_b": 25}),
    "lenpen0.6": dict(beam=5, bsz=5, src=9, opts={"max_len_b": 30, "len_penalty": 0.6}),
    "lenpen1.4": dict(beam=5, bsz=5, src=9, opts={"max_len_b": 30, "len_penalty": 1.4}),
    "unkpen0.5": dict(beam=5, bsz=5, src=9, opts={"max_len_b": 30, "unk_penalty": 0.5}),
    # a negative penalty: unk wins somewhere, so the penalty shows in the chosen tokens' scores
    "unkpen-3": dict(beam=3, bsz=5, src=9, opts={"max_len_b": 20, "unk_penalty": -3.0}),
    "unnormalized": dict(beam=5, bsz=5, src=9, opts={"max_len_b": 30,
                                                     "normalize_scores": False}),
    # min_len keeps every hypothesis >= 37 tokens: capacity 16 -> 32 -> 45 (max_len + 1)
    "beam5_long": dict(beam=5, bsz=3, src=7, opts={"max_len_a": 0, "max_len_b": 44,
                                                  "min_len": 36}),
    "greedy_long": dict(beam=1, bsz=3, src=7, opts={"max_len_b": 44, "min_len": 36}),
    # max_len = int(1.2 * 11 + 3) = 16: the capacity grows from 16 to 17
    "max_len_a": dict(beam=5, bsz=5, src=11, opts={"max_len_a": 1.2, "max_len_b": 3}),
    "ctor_max_len": dict(beam=4, bsz=4, src=9, opts={"max_len_b": 30, "max_len": 6}),
    "max_len0": dict(beam=5, bsz=4, src=6, opts={"max_len_a": 0, "max_len_b": 0,
                                                 "min_len": 0}),
    "max_len1": dict(beam=5, bsz=4, src=6, opts={"max_len_a": 0, "max_len_b": 1}),
    "max_len2": dict(beam=3, bsz=4, src=6, opts={"max_len_a": 0, "max_len_b": 2}),
    "temperature0.7": dict(beam=5, bsz=5, src=9, opts={"max_len_b": 30, "temperature": 0.7}),
    "bos": dict(beam=5, bsz=5, src=9, opts={"max_len_b": 30}, bos=True),
    "padded": dict(beam=5, src=16, opts={"max_len_b": 30}, padded=[16, 1, 2, 1, 3, 1]),
}


def _case_sample(dictionary, case, seed):
    spec = GENERATIONS[case]
    if "padded" in spec:
        return _padded_sample(dictionary, spec["padded"], spec["src"], seed)
    return _sample(dictionary, spec["bsz"], spec["src"], seed)


def _layout(monkeypatch, layout):
    """``padded``: the eager steps take the CUDA graphs' shapes (the source rounded up to a
    bucket, attention over the whole capacity, unwritten positions masked), the way the GPU
    decodes half-precision models; ``exact`` (the CPU's default): attention over the positions
    so far."""
    monkeypatch.setattr(generator_module, "PAD_EAGER", layout == "padded")


@pytest.mark.parametrize("weights,layout", [("plain", "exact"), ("eos_biased", "exact"),
                                            ("eos_biased", "padded")])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("case", list(GENERATIONS))
def test_fixed_path_matches_fairseq(case, name, weights, layout, models, dictionary, fixed,
                                    monkeypatch):
    _layout(monkeypatch, layout)
    spec = GENERATIONS[case]
    ref, ls = models(name, MIXED[name] if weights == "eos_biased" else None)
    sample = _case_sample(dictionary, case, seed=len(case) + 3)
    kwargs = {"bos_token": dictionary.bos()} if spec.get("bos") else {}
    ref_hyps = SequenceGenerator([ref], dictionary, beam_size=spec["beam"],
                                 **spec["opts"]).generate([ref], sample, **kwargs)
    gen = LSSequenceGenerator([ls], dictionary, beam_size=spec["beam"], **spec["opts"])
    hyps = gen.generate([ls], sample, **kwargs)
    assert len(fixed.results) == 1 and hyps is fixed.results[0]  # the fixed path decoded
    _assert_same_hypotheses(hyps, ref_hyps)
    fixed.assert_stopped(0, ref_hyps)
    lengths = [n for sent in _lengths(ref_hyps) for n in sent]
    if "long" in case:
        assert min(lengths) >= 37 and fixed.capacities[0] == [16, 32, 45]
    if case == "max_len_a":
        assert max(lengths) <= 17
        if weights == "plain":
            assert fixed.capacities[0] == [16, 17]
    if case == "ctor_max_len":
        assert max(lengths) <= 6
    if case == "max_len0":
        assert all(h["tokens"].tolist() == [dictionary.eos()] for s in hyps for h in s)
    if case in ("max_len1", "max_len2"):  # min_len 1: eos from the second token on
        longest = int(case[-1]) + 1
        assert set(lengths) <= set(range(2, longest + 1)) and longest in lengths
    if case == "unkpen-3":
        assert any(h["tokens"].eq(dictionary.unk()).any() for s in ref_hyps for h in s)
    if case == "bos":  # bos_token changes the decoding (it is the first decoder input)
        plain = SequenceGenerator([ref], dictionary, beam_size=spec["beam"],
                                  **spec["opts"]).generate([ref], sample)
        assert any(not torch.equal(a["positional_scores"], b["positional_scores"])
                   for s, t in zip(plain, ref_hyps) for a, b in zip(s, t))


@pytest.mark.parametrize("layout", ["exact", "padded"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("regime", ["mixed", "mixed_greedy", "early"])
def test_sentences_ending_at_different_steps(name, regime, layout, models, dictionary, fixed,
                                             monkeypatch):
    """An eos bias makes hypotheses end from step 1 on: sentences leave fairseq's batch at
    different steps (in the fixed batch they go on, recording nothing), and a sentence's
    hypotheses end at different steps (its finished slots fill over several steps). Compared
    with fairseq's transformer and with the same ls_ model under fairseq's own loop."""
    _layout(monkeypatch, layout)
    bias, beam = {"mixed": (MIXED, 5), "mixed_greedy": (MIXED_GREEDY, 1),
                  "early": (EARLY, 5)}[regime]
    ref, ls = models(name, bias[name])
    sample = _sample(dictionary, 7, 11, seed=3)
    opts = {"max_len_b": 30}
    ref_hyps = SequenceGenerator([ref], dictionary, beam_size=beam, **opts).generate([ref], sample)
    ls_fairseq_hyps = SequenceGenerator([ls], dictionary, beam_size=beam, **opts).generate(
        [ls], sample)
    hyps = LSSequenceGenerator([ls], dictionary, beam_size=beam, **opts).generate([ls], sample)
    assert len(fixed.results) == 1 and hyps is fixed.results[0]
    _assert_same_hypotheses(hyps, ref_hyps)
    _assert_same_hypotheses(hyps, ls_fairseq_hyps)

    # what the bias was chosen for (else this test would not exercise finalisation)
    lengths = _lengths(ref_hyps)
    ends = [max(sent) for sent in lengths]  # a sentence ends with its longest hypothesis
    if regime == "early":
        assert max(ends) <= 7  # every sentence ended far below max_len (31 tokens)
        assert fixed.steps[0] <= 10
    else:
        assert min(ends) <= 6 and max(ends) >= 15
    if beam > 1:
        assert all(len(sent) == beam for sent in lengths)
        assert sum(len(set(sent)) > 1 for sent in lengths) >= 3
    fixed.assert_stopped(0, ref_hyps)


# (config, beam, eos bias, sample seed): 9 sentences ending at different steps, whose batch
# shrinks 9 -> 4 -> 2 -> 1 (4: 3 sentences + 1 finished copy), 9 -> 2 -> 1, 9 -> 2, or at once
# (every sentence had finished when the count was read)
REDUCTIONS = [("post_ln_shared", 4, 2.75, 5), ("post_ln_shared", 4, 3.0, 5),
              ("pre_ln_t2t", 4, 1.5, 5), ("learned_pos", 4, 2.0, 5),
              ("pre_ln_t2t", 1, 2.5, 6), ("learned_pos", 1, 2.5, 6)]


@pytest.mark.parametrize("layout", ["exact", "padded"])
def test_batch_reduction(layout, models, dictionary, fixed, monkeypatch):
    """fairseq's batch reduction, in powers of two (here once at most half of the sentences are
    unfinished): the same hypotheses as fairseq's. The smaller workspaces are kept: the same
    batch again, and a batch of 4 sentences (the size of a reduced batch), decode as a fresh
    generator does, bit for bit."""
    _layout(monkeypatch, layout)
    monkeypatch.setattr(generator_module, "SHRINK", 2)
    opts = {"max_len_b": 30}
    seen, firsts = [], []
    for case in REDUCTIONS:
        name, beam, bias, seed = case
        ref, ls = models(name, bias)
        sample = _sample(dictionary, 9, 10, seed)
        ref_hyps = SequenceGenerator([ref], dictionary, beam_size=beam, **opts).generate(
            [ref], sample)
        ls_fairseq_hyps = SequenceGenerator([ls], dictionary, beam_size=beam, **opts).generate(
            [ls], sample)
        gen = LSSequenceGenerator([ls], dictionary, beam_size=beam, **opts)
        call = len(fixed.results)
        hyps = gen.generate([ls], sample)
        assert len(fixed.results) == call + 1 and hyps is fixed.results[-1], case
        _assert_same_hypotheses(hyps, ref_hyps)
        _assert_same_hypotheses(hyps, ls_fairseq_hyps)
        fixed.assert_stopped(call, ref_hyps)
        shrinks = fixed.shrinks[call]
        assert shrinks, case
        sizes = [9] + [to or 0 for _, to, _ in shrinks]
        assert all(a > b for a, b in zip(sizes, sizes[1:])), (case, shrinks)
        assert all(to is None or (to >= kept and to & (to - 1) == 0)
                   for _, to, kept in shrinks), (case, shrinks)
        seen += shrinks
        firsts.append(shrinks[0][0])

        _assert_identical(gen.generate([ls], sample), hyps)
        small = _sample(dictionary, 4, 7, seed + 1)
        _assert_identical(gen.generate([ls], small), LSSequenceGenerator(
            [ls], dictionary, beam_size=beam, **opts).generate([ls], small))
    # what the cases were chosen for
    assert any(to is not None and to > kept for _, to, kept in seen), seen  # finished copies
    assert any(to == kept for _, to, kept in seen), seen
    assert sum(to == 1 for _, to, _ in seen) >= 2, seen
    if layout == "exact":
        assert any(to is None for _, to, _ in seen), seen
    # the first reduction of each case starts from the batch's workspace: 9 sentences, or in
    # the graphs' layout 16 (9 and 7 finished copies)
    assert firsts == [9 if layout == "exact" else 16] * len(REDUCTIONS), firsts


@pytest.mark.parametrize("sizes", [(5, 3, 9, 12, 5), (1, 2, 7, 8, 17)])
def test_batch_buckets_and_workspace_eviction(sizes, models, dictionary, fixed, monkeypatch):
    """The graphs' layout rounds a batch up (5 -> 8, 9 -> 16, 12 -> 16, 17 -> 24, 3 -> 4) with
    finished copies of its first sentence, and keeps at most MAX_WORKSPACES workspaces (here 2):
    every batch still matches fairseq, and an evicted shape decodes again as a fresh
    generator does."""
    _layout(monkeypatch, "padded")
    monkeypatch.setattr(generator_module, "MAX_WORKSPACES", 2)
    ref, ls = models("pre_ln_t2t", MIXED["pre_ln_t2t"])
    opts = {"max_len_b": 25}
    gen = LSSequenceGenerator([ls], dictionary, beam_size=3, **opts)
    for i, bsz in enumerate(sizes):
        sample = _sample(dictionary, bsz, 9, seed=20 + i)
        hyps = gen.generate([ls], sample)
        assert len(hyps) == bsz
        _assert_same_hypotheses(hyps, SequenceGenerator([ref], dictionary, beam_size=3,
                                                        **opts).generate([ref], sample))
        _assert_identical(hyps, LSSequenceGenerator([ls], dictionary, beam_size=3,
                                                    **opts).generate([ls], sample))
        bucket = generator_module._batch_bucket(bsz)
        assert bucket >= bsz and (bucket, 3) in gen._workspaces, (bsz, list(gen._workspaces))
        assert len(gen._workspaces) <= 2


# ------------------------------------------------------------------- fallbacks to fairseq's loop

FALLBACKS = {
    # name: (beam, SequenceGenerator options, generate kwargs maker, the log line names)
    "prefix": (4, {"max_len_b": 20}, "prefix", "--prefix-size"),
    "match_source_len": (4, {"match_source_len": True}, None, "--match-source-len"),
    "no_repeat_ngram": (4, {"max_len_b": 20, "no_repeat_ngram_size": 2}, None,
                        "--no-repeat-ngram-size"),
    "sampling": (3, {"max_len_b": 20, "search": "sampling"}, None, "--sampling"),
    "tokens_to_suppress": (4, {"max_len_b": 20, "tokens_to_suppress": ("w7",)}, None,
                           "tokens to suppress"),
    "ensemble": (4, {"max_len_b": 20}, None, "ensemble"),
    "fairseq_model": (4, {"max_len_b": 20}, None, "a model other than ls_transformer"),
    "env_fairseq": (4, {"max_len_b": 20}, None, f"{ENV}=fairseq"),
}


def _fallback_generator(cls, model_list, dictionary, beam, opts):
    opts = dict(opts)
    if opts.pop("search", None) == "sampling":
        opts["search_strategy"] = search.Sampling(dictionary, sampling_topk=8)
    return cls(model_list, dictionary, beam_size=beam, **opts)


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_fallback_is_fairseqs_loop(case, models, dictionary, fixed, monkeypatch, caplog):
    beam, opts, kwargs_kind, names = FALLBACKS[case]
    ref, ls = models("pre_ln_t2t", MIXED["pre_ln_t2t"])
    model_list = [ls]
    if case == "ensemble":
        model_list = [ls, models("learned_pos", MIXED["learned_pos"])[1]]
    elif case == "fairseq_model":
        model_list = [ref]
    elif case == "env_fairseq":
        monkeypatch.setenv(ENV, "fairseq")
    samples = [_sample(dictionary, 5, 9, seed=1), _sample(dictionary, 4, 7, seed=2)]
    kwargs = [{}, {}]
    if kwargs_kind == "prefix":
        for i, s in enumerate(samples):
            bsz = s["net_input"]["src_tokens"].size(0)
            prefix = torch.randint(dictionary.nspecial, len(dictionary), (bsz, 2),
                                   generator=torch.Generator().manual_seed(i))
            prefix[1, -1] = dictionary.pad()
            kwargs[i] = {"prefix_tokens": prefix}

    gen = _fallback_generator(LSSequenceGenerator, model_list, dictionary, beam, opts)
    ref_gen = _fallback_generator(SequenceGenerator, model_list, dictionary, beam, opts)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for sample, kw in zip(samples, kwargs):
            torch.manual_seed(7)  # sampling: the same draws
            hyps = gen.generate(model_list, sample, **kw)
            torch.manual_seed(7)
            ref_hyps = ref_gen.generate(model_list, sample, **kw)
            _assert_same_hypotheses(hyps, ref_hyps, exact=True)
    assert fixed.results == []
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines  # two calls, one line
    assert names in lines[0] and "fixed-shape beam search is off" in lines[0], lines


def test_one_log_line_per_reason_and_the_fixed_path_without_it(models, dictionary, fixed,
                                                               caplog):
    """One generator: prefix tokens fall back (one line for two calls), a call without them
    takes the fixed path, no line."""
    _, ls = models("post_ln_shared", MIXED["post_ln_shared"])
    gen = LSSequenceGenerator([ls], dictionary, beam_size=3, max_len_b=15)
    sample = _sample(dictionary, 3, 8, seed=4)
    prefix = torch.full((3, 1), dictionary.nspecial + 1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        gen.generate([ls], sample, prefix_tokens=prefix)
        assert fixed.results == []
        gen.generate([ls], sample)
        assert len(fixed.results) == 1
        gen.generate([ls], sample, prefix_tokens=prefix)
        assert len(fixed.results) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "--prefix-size" in lines[0], lines


# --------------------------------------------------------------------------- LS_FAIRSEQ_GENERATOR

def test_bad_mode_raises(models, dictionary, monkeypatch):
    ref, ls = models("post_ln_shared")
    gen = LSSequenceGenerator([ls], dictionary, beam_size=2, max_len_b=5)
    sample = _sample(dictionary, 2, 5, seed=1)
    monkeypatch.setenv(ENV, "bogus")
    with pytest.raises(ValueError, match=ENV):
        gen.generate([ls], sample)
    with pytest.raises(ValueError, match=ENV):  # and where the generator is chosen
        FairseqTask.build_generator(DummyTask(dictionary), [ls], argparse.Namespace(beam=2))


def test_eager_mode_is_the_fixed_path(models, dictionary, monkeypatch, fixed):
    """``eager`` (any case, spaces around) is what the CPU runs by default: the same result."""
    _, ls = models("learned_pos", MIXED["learned_pos"])
    sample = _sample(dictionary, 4, 9, seed=6)
    default = LSSequenceGenerator([ls], dictionary, beam_size=3, max_len_b=20).generate(
        [ls], sample)
    monkeypatch.setenv(ENV, " Eager ")
    eager = LSSequenceGenerator([ls], dictionary, beam_size=3, max_len_b=20).generate(
        [ls], sample)
    assert len(fixed.results) == 2
    _assert_identical(eager, default)


# ------------------------------------------------------------------------------ workspace reuse

# (sentences, longest source, seed): same shape with a longer source (and so a longer max_len),
# then a shorter one (the grown workspace serves it), another batch size, the first batch again
BATCHES = [(3, 6, 1), (3, 12, 2), (3, 5, 3), (5, 7, 4), (3, 6, 1)]
WORKSPACE_OPTS = {"max_len_a": 1.5, "max_len_b": 3}


def _decode_batches(models, dictionary, check):
    """Decodes BATCHES with one generator; ``check(i, hyps, fresh_hyps, ref_hyps)`` after each."""
    ref, ls = models("pre_ln_t2t", MIXED["pre_ln_t2t"])
    gen = LSSequenceGenerator([ls], dictionary, beam_size=4, **WORKSPACE_OPTS)
    workspaces = []
    for i, (bsz, src_len, seed) in enumerate(BATCHES):
        sample = _sample(dictionary, bsz, src_len, seed)
        hyps = gen.generate([ls], sample)
        fresh = LSSequenceGenerator([ls], dictionary, beam_size=4, **WORKSPACE_OPTS).generate(
            [ls], sample)
        ref_hyps = SequenceGenerator([ref], dictionary, beam_size=4, **WORKSPACE_OPTS).generate(
            [ref], sample)
        check(i, hyps, fresh, ref_hyps)
        workspaces.append(dict(gen._workspaces))
    return workspaces


def test_workspace_reuse(models, dictionary, fixed):
    def check(i, hyps, fresh, ref_hyps):
        _assert_identical(hyps, fresh)
        _assert_same_hypotheses(hyps, ref_hyps)

    ws = _decode_batches(models, dictionary, check)
    assert len(fixed.results) == 2 * len(BATCHES)  # this generator and a fresh one
    first, grown = ws[0][3, 4], ws[1][3, 4]
    assert grown is not first  # a longer source and max_len: regrown
    assert grown.cross.size(1) >= 12 and grown.state.width >= int(1.5 * 12 + 3) + 2
    assert ws[2][3, 4] is grown and ws[4][3, 4] is grown  # smaller batches reuse it
    assert ws[3][3, 4] is grown and (5, 4) in ws[3] and (5, 4) not in ws[2]


def test_results_stay_valid_after_later_batches(models, dictionary):
    """fairseq-interactive keeps the hypotheses of every batch of its buffer until all are
    decoded: a batch's result must not change when the generator decodes the next ones."""
    kept = []

    def check(i, hyps, fresh, ref_hyps):
        kept.append((hyps, _snapshot(fresh)))

    _decode_batches(models, dictionary, check)
    for i, (hyps, fresh) in enumerate(kept):
        assert len(hyps) == len(fresh)
        for sent, (mine, theirs) in enumerate(zip(hyps, fresh)):
            for a, b in zip(mine, theirs):
                assert torch.equal(a["tokens"], b["tokens"]), (i, sent, a["tokens"], b["tokens"])
                assert torch.equal(a["score"], b["score"]), (i, sent)
                assert torch.equal(a["positional_scores"], b["positional_scores"]), (i, sent)


# -------------------------------------------------------------- patch 5: task.build_generator

def _gen_args(**kw):
    base = dict(beam=3, max_len_a=0, max_len_b=17, min_len=2, lenpen=0.7, unkpen=0.25,
                temperature=0.9, unnormalized=False)
    base.update(kw)
    return argparse.Namespace(**base)


class _MyGenerator(SequenceGenerator):
    pass


def test_build_generator_class(models, dictionary, monkeypatch):
    fairseq_patches.install()
    assert fairseq_patches.installed()[FairseqTask, "build_generator"]
    assert FairseqTask.build_generator.__wrapped__.__module__ == "fairseq.tasks.fairseq_task"
    assert TranslationTask.build_generator is FairseqTask.build_generator
    task = DummyTask(dictionary)
    ref, ls = models("post_ln_shared")
    _, ls2 = models("pre_ln_t2t")
    build = TranslationTask.build_generator

    gen = build(task, [ls], _gen_args())
    assert type(gen) is LSSequenceGenerator
    # fairseq's arguments, passed on unchanged
    assert (gen.beam_size, gen.max_len_b, gen.min_len, gen.len_penalty, gen.unk_penalty,
            gen.temperature, gen.normalize_scores) == (3, 17, 2, 0.7, 0.25, 0.9, True)
    assert type(gen.search) is search.BeamSearch
    assert type(build(task, [ls, ls2], _gen_args())) is LSSequenceGenerator  # all ls_
    assert type(build(task, [ref], _gen_args())) is SequenceGenerator
    assert type(build(task, [ls, ref], _gen_args())) is SequenceGenerator
    assert type(build(task, [ls], _gen_args(print_alignment="hard"))) is \
        SequenceGeneratorWithAlignment
    assert type(build(task, [ls], _gen_args(score_reference=True))) is SequenceScorer
    assert type(build(task, [ls], _gen_args(), seq_gen_cls=_MyGenerator)) is _MyGenerator
    sampler = build(task, [ls], _gen_args(sampling=True, sampling_topk=5))
    assert type(sampler) is LSSequenceGenerator and type(sampler.search) is search.Sampling
    monkeypatch.setenv(ENV, "fairseq")
    assert type(build(task, [ls], _gen_args())) is SequenceGenerator


def test_built_generators_match(models, dictionary, fixed):
    """The generators task.build_generator makes for the two models decode alike."""
    task = DummyTask(dictionary)
    ref, ls = models("learned_pos", MIXED["learned_pos"])
    args = _gen_args(beam=4, max_len_b=25, min_len=1, unkpen=0, temperature=1.0)
    sample = _sample(dictionary, 5, 10, seed=8)
    ref_hyps = FairseqTask.build_generator(task, [ref], args).generate([ref], sample)
    hyps = FairseqTask.build_generator(task, [ls], args).generate([ls], sample)
    assert len(fixed.results) == 1 and hyps is fixed.results[0]
    _assert_same_hypotheses(hyps, ref_hyps)


# --------------------------------------------------------------------------------- StaticKVCache

def _static_cache(layers=2, rows=3, heads=2, capacity=5, dim=4):
    buffer = torch.zeros(layers, 2, rows, heads, capacity, dim)
    mask = torch.zeros(rows, capacity, dtype=torch.bool)
    cache = StaticKVCache(buffer, mask, torch.zeros(1, dtype=torch.long))
    cache.step.fill_(3)
    cache.row_table.fill_(0)
    cache.reset()
    return cache


def test_static_cache_steps():
    g = torch.Generator().manual_seed(0)
    cache = _static_cache()
    pad = 1
    assert cache.mask.all() and int(cache.step) == 0
    assert torch.equal(cache.row_table, torch.arange(3).unsqueeze(1).expand(3, 5))
    assert (cache.num_layers, cache.rows, cache.capacity) == (2, 3, 5)
    written = torch.zeros_like(cache.buffer)
    for step in range(3):
        positions = cache.positions(pad)
        assert positions.shape == (3, 1) and positions.eq(pad + 1 + step).all()
        tokens = torch.tensor([[5], [pad], [7]]) if step == 1 else torch.tensor([[5], [6], [7]])
        mask = cache.begin_step(tokens, pad)
        assert mask is cache.mask
        expect = torch.ones(3, 5, dtype=torch.bool)
        expect[:, :step + 1] = False
        if step >= 1:
            expect[1, 1] = True  # the padding token of step 1
        assert torch.equal(mask, expect), step
        for layer in range(2):
            kv = torch.randn(3, 1, 2, 2, 4, generator=g)
            k, v, m = cache.append(layer, kv)
            written[layer, :, :, :, step] = kv[:, 0].permute(1, 0, 2, 3)
            assert k.shape == (3, 2, 5, 4) and v.shape == (3, 2, 5, 4) and m is cache.mask
            assert k.data_ptr() == cache.buffer[layer, 0].data_ptr()
            assert torch.equal(k, written[layer, 0]) and torch.equal(v, written[layer, 1])
        assert torch.equal(cache.buffer, written)  # only this step's position changed
        cache.advance()
        assert int(cache.step) == step + 1


def test_static_cache_reorder_and_views():
    """Rows permuted and duplicated (never dropped): the row table and mask move, the keys/values
    stay; a cache over views of larger buffers writes into them."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(2, 2, 4, 2, 8, 3, generator=g)
    big_mask = torch.rand(4, 8, generator=g) < 0.5
    big_table = torch.randint(0, 4, (4, 8), generator=g)
    before, before_mask, before_table = big.clone(), big_mask.clone(), big_table.clone()
    cache = StaticKVCache(big[:, :, :, :, :5], big_mask[:, :5], torch.tensor([2]),
                          big_table[:, :5])
    order = torch.tensor([2, 0, 0, 3])
    cache.reorder(order)
    assert torch.equal(big, before)  # no key/value moved
    assert torch.equal(big_mask[:, :5], before_mask[:, :5].index_select(0, order))
    assert torch.equal(big_table[:, :5], before_table[:, :5].index_select(0, order))
    assert torch.equal(big_mask[:, 5:], before_mask[:, 5:])  # outside the view: kept
    assert torch.equal(big_table[:, 5:], before_table[:, 5:])
    kv = torch.randn(4, 1, 2, 2, 3, generator=g)
    cache.begin_step(torch.tensor([[4], [5], [6], [7]]), padding_idx=1)
    assert torch.equal(big_table[:, 2], torch.arange(4))  # step 2 is written by each row itself
    cache.append(1, kv)
    assert torch.equal(big[1, :, :, :, 2], kv[:, 0].permute(1, 0, 2, 3))


def test_static_cache_reads_like_a_reordered_cache():
    """Steps with beam reorders: keys/values read through the row table equal those of a cache
    that moves them (fairseq's reorder), and select_from (a shrinking batch) gathers them."""
    from ls_fairseq.ops.decode_attention import gather_rows

    g = torch.Generator().manual_seed(3)
    layers, rows, heads, capacity, dim = 2, 6, 2, 7, 3
    cache = _static_cache(layers, rows, heads, capacity, dim)
    moved = torch.zeros(layers, 2, rows, heads, capacity, dim)
    for step in range(5):
        cache.begin_step(torch.full((rows, 1), 4), padding_idx=1)
        for layer in range(layers):
            kv = torch.randn(rows, 1, 2, heads, dim, generator=g)
            k, v, _ = cache.append(layer, kv)
            moved[layer, :, :, :, step] = kv[:, 0].permute(1, 0, 2, 3)
            length = step + 1
            table = cache.row_table[:, :length]
            assert torch.equal(gather_rows(k[:, :, :length], table), moved[layer, 0, :, :, :length])
            assert torch.equal(gather_rows(v[:, :, :length], table), moved[layer, 1, :, :, :length])
        order = torch.randint(0, rows, (rows,), generator=g)
        cache.reorder(order)
        moved = moved.index_select(2, order)
        cache.advance()
    keep = torch.tensor([4, 1, 1])
    small = _static_cache(layers, 3, heads, capacity, dim)
    small.select_from(cache, keep)
    assert int(small.step) == 5
    assert torch.equal(small.buffer[..., :5, :], moved.index_select(2, keep)[..., :5, :])
    assert torch.equal(small.mask, cache.mask.index_select(0, keep))
    assert torch.equal(small.row_table, torch.arange(3).unsqueeze(1).expand(3, capacity))
    with pytest.raises(ValueError, match="select_from"):
        small.select_from(cache, torch.tensor([0, 1]))  # not one source row per row
    with pytest.raises(ValueError, match="select_from"):
        small.select_from(_static_cache(layers, rows, heads, capacity + 1, dim), keep)


def test_static_cache_copy_from():
    g = torch.Generator().manual_seed(2)
    small = _static_cache(capacity=3)
    small.buffer.copy_(torch.randn(small.buffer.shape, generator=g))
    small.mask.copy_(torch.rand(small.mask.shape, generator=g) < 0.5)
    small.step.fill_(2)
    large = _static_cache(capacity=6)
    large.buffer.copy_(torch.randn(large.buffer.shape, generator=g))
    large.mask.fill_(False)
    small.row_table.copy_(torch.randint(0, 3, small.row_table.shape, generator=g))
    tail = large.buffer[..., 3:, :].clone()
    large.copy_from(small)
    assert torch.equal(large.buffer[..., :3, :], small.buffer)
    assert torch.equal(large.buffer[..., 3:, :], tail)
    assert torch.equal(large.mask[:, :3], small.mask) and large.mask[:, 3:].all()
    assert torch.equal(large.row_table[:, :3], small.row_table)
    assert torch.equal(large.row_table[:, 3:], torch.arange(3).unsqueeze(1).expand(3, 3))
    assert int(large.step) == 2
    with pytest.raises(ValueError, match="copy_from"):
        small.copy_from(large)  # a larger capacity
    with pytest.raises(ValueError, match="copy_from"):
        large.copy_from(_static_cache(rows=4, capacity=3))


@pytest.mark.parametrize("buffer_shape,mask_shape", [
    ((2, 2, 3, 2, 5), (3, 5)),        # not 6-d
    ((2, 3, 3, 2, 5, 4), (3, 5)),     # not keys and values
    ((2, 2, 3, 2, 5, 4), (3, 4)),     # mask of another capacity
    ((2, 2, 3, 2, 5, 4), (4, 5)),     # mask of other rows
    ((2, 2, 3, 2, 5, 4), (3, 5, 1)),  # mask not 2-d
])
def test_static_cache_bad_shapes(buffer_shape, mask_shape):
    with pytest.raises(ValueError, match="StaticKVCache needs"):
        StaticKVCache(torch.zeros(buffer_shape), torch.ones(mask_shape, dtype=torch.bool),
                      torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("table", [torch.zeros(3, 4, dtype=torch.long),  # another capacity
                                   torch.zeros(3, 5, dtype=torch.int32)])  # not int64
def test_static_cache_bad_row_table(table):
    with pytest.raises(ValueError, match="row_table"):
        StaticKVCache(torch.zeros(2, 2, 3, 2, 5, 4), torch.ones(3, 5, dtype=torch.bool),
                      torch.zeros(1, dtype=torch.long), table)


def test_cross_keys_once_per_sentence_through_fairseqs_reorders(models, dictionary):
    """Cross-attention keys/values stored once per sentence (``"rows"``: each row's sentence, in
    the decoder's ``encoder_kv`` state, as LSSequenceGenerator stores them) decode like the
    decoder's own per-row copies, through fairseq's incremental steps and reorders
    (``reorder_incremental_state`` then moves the index, not the keys/values)."""
    _, ls = models("pre_ln_t2t")
    beam, bsz = 3, 4
    sample = _sample(dictionary, bsz, 9, seed=21)
    src = sample["net_input"]["src_tokens"]
    g = torch.Generator().manual_seed(4)
    prev = torch.randint(4, len(dictionary), (bsz * beam, 5), generator=g)
    prev[:, 0] = dictionary.eos()
    order = torch.arange(bsz).repeat_interleave(beam)
    with torch.no_grad():
        enc = ls.encoder(src, sample["net_input"]["src_lengths"])
        beams = ls.encoder.reorder_encoder_out(enc, order)
        attns = [layer.encoder_attn for layer in ls.decoder.layers]
        per_sentence = ls.decoder.encoder_kv.project(enc["encoder_out"][0].transpose(0, 1), attns)
        # beam reorders within sentences, then sentence 1 finished (fairseq drops its rows)
        reorders = {2: torch.tensor([2, 0, 1, 3, 3, 5, 8, 6, 7, 11, 9, 10]),
                    3: torch.tensor([0, 0, 2, 6, 7, 8, 9, 10, 9])}
        copies = _decode_steps(ls, beams, prev, reorders)
        state = {}
        ls.decoder.set_incremental_state(state, "encoder_kv",
                                         {"kv": per_sentence, "rows": order.clone()})
        shared = _decode_steps(ls, beams, prev, reorders, state)
        cached = ls.decoder.get_incremental_state(state, "encoder_kv")
        assert cached["kv"] is per_sentence  # never copied
        assert cached["rows"].tolist() == [0, 0, 0, 2, 2, 2, 3, 3, 3]
    for a, b in zip(copies, shared):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
