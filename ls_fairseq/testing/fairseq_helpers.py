"""Shared helpers: build fairseq and ls_ models/criteria from the real fairseq option parser."""
import argparse

import torch
from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_MODEL_REGISTRY

import ls_fairseq  # noqa: F401  (registers the ls_ components)


#: a tiny Transformer of every architecture: 2 encoder / 3 decoder layers of width 24, 4 heads,
#: FFN 40 (odd sizes), dropout off (the model tests compare against fairseq without masks)
TINY = [
    "--encoder-layers", "2", "--decoder-layers", "3",
    "--encoder-embed-dim", "24", "--decoder-embed-dim", "24",
    "--encoder-ffn-embed-dim", "40", "--decoder-ffn-embed-dim", "40",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0",
]


def make_dictionary(num_symbols=37):
    d = Dictionary()
    for i in range(num_symbols):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=1)
    return d


class IndexDataset(torch.utils.data.Dataset):
    """Items are their indices: enough for fairseq's batch iterators, which read a dataset's
    ``supports_prefetch`` flag and no item (tests of batch order)."""
    supports_prefetch = False

    def __getitem__(self, i):
        return i

    def __len__(self):
        return 10 ** 6


class DummyTask:
    def __init__(self, dictionary):
        self.source_dictionary = dictionary
        self.target_dictionary = dictionary


def model_args(arch, extra=()):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["/nonexistent", "--arch", arch, "--task", "translation", *extra]
    )
    return args


def build_model(arch, dictionary, extra=(), seed=0):
    args = model_args(arch, extra)
    torch.manual_seed(seed)
    return ARCH_MODEL_REGISTRY[arch].build_model(args, DummyTask(dictionary))


def build_pair(arch, dictionary, extra=(), seed=0):
    """fairseq's model for `arch` and the ls_ twin, both from the same seed."""
    ref = build_model(arch, dictionary, extra, seed)
    ls = build_model("ls_" + arch, dictionary, extra, seed)
    return ref, ls


def random_batch(dictionary, bsz, src_len, tgt_len, generator=None, left_pad_source=True):
    """Token batches with varying lengths and padding (fairseq's default padding sides)."""
    g = generator
    pad, eos = dictionary.pad(), dictionary.eos()
    low, high = dictionary.nspecial, len(dictionary)
    src = torch.full((bsz, src_len), pad, dtype=torch.long)
    prev = torch.full((bsz, tgt_len), pad, dtype=torch.long)
    tgt = torch.full((bsz, tgt_len), pad, dtype=torch.long)
    src_lengths = torch.randint(1, src_len + 1, (bsz,), generator=g)
    src_lengths[0] = src_len
    tgt_lengths = torch.randint(1, tgt_len + 1, (bsz,), generator=g)
    tgt_lengths[-1] = tgt_len
    for i in range(bsz):
        ls, lt = int(src_lengths[i]), int(tgt_lengths[i])
        s = torch.randint(low, high, (ls,), generator=g)
        s[-1] = eos
        if left_pad_source:
            src[i, src_len - ls:] = s
        else:
            src[i, :ls] = s
        t = torch.randint(low, high, (lt,), generator=g)
        t[-1] = eos
        tgt[i, :lt] = t
        prev[i, 0] = eos
        prev[i, 1:lt] = t[:-1]
    return src, src_lengths, prev, tgt


def random_sample(dictionary, bsz, src_len, tgt_len, generator=None):
    """A fairseq translation sample (net_input, target, ntokens) around :func:`random_batch`."""
    src, src_lengths, prev, tgt = random_batch(dictionary, bsz, src_len, tgt_len, generator)
    return {
        "net_input": {"src_tokens": src, "src_lengths": src_lengths, "prev_output_tokens": prev},
        "target": tgt,
        "ntokens": int(tgt.ne(dictionary.pad()).sum()),
    }


def run_criterion(criterion, model, sample):
    """``criterion(model, sample)`` and its backward from zero gradients: (loss, sample_size,
    logging_output, {parameter name: gradient})."""
    model.zero_grad()
    loss, sample_size, logging_output = criterion(model, sample)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return loss.detach(), sample_size, logging_output, grads


def grad_err(key, grad, ref_grads):
    """Error of parameter ``key``'s gradient against ``ref_grads[key]``: max |a - b| / max |b|,
    except for attention query/key projections. Their gradients pass through the softmax
    gradient dS = P * (dP - sum(P dP)), which cancels, so they carry rounding error of the size
    of the attention block's gradients (and are exactly zero in exact arithmetic for the key
    bias, or when every row has a single key): they are measured against the block's
    value-projection gradient."""
    ref = ref_grads[key]
    denom = float(ref.abs().max())
    if ".k_proj." in key or ".q_proj." in key:
        v_key = key.replace(".k_proj.", ".v_proj.").replace(".q_proj.", ".v_proj.")
        denom = max(denom, float(ref_grads[v_key].abs().max()))
    return float((grad.double() - ref.double()).abs().max()) / max(denom, 1e-30)


def max_rel_err(a, b):
    """max |a - b| / max |b|: the error scale relative to the tensor's magnitude."""
    a, b = a.double(), b.double()
    denom = b.abs().max().clamp_min(1e-30)
    return float((a - b).abs().max() / denom)


def fp16_optimizer_cfg(optimizer, extra=()):
    """A fairseq config with --fp16 and the given optimizer flags (for FP16Optimizer tests)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        "/nonexistent", "--arch", "transformer", "--task", "translation", "--optimizer",
        optimizer, "--lr", "1e-3", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01",
        "--fp16", "--fp16-init-scale", "128", *extra])
    return convert_namespace_to_omegaconf(args)


def fp16_trainer_run(opt, params, steps, seed, overflow_at=(), update_freq=1, clip=0.0):
    """fairseq's trainer sequence around an FP16Optimizer: zero_grad; ``update_freq`` backward
    passes through ``opt.backward`` (loss scaling); multiply_grads; clip_grad_norm (an
    OverflowError skips the step, as the trainer does); step. The loss is linear in the weights
    with a fixed random coefficient sequence, so every optimizer sees the same gradients however
    its weights have rounded; at the updates in ``overflow_at`` one gradient element is inf.
    Returns (OverflowErrors raised, grad norms returned by clip_grad_norm)."""
    device = params[0].device
    g = torch.Generator(device=device).manual_seed(seed)
    overflows, norms = 0, []
    for step in range(steps):
        opt.zero_grad()
        for k in range(update_freq):
            coef = [torch.randn(p.shape, generator=g, device=device) * 0.01 for p in params]
            if step in overflow_at and k == 0:
                coef[0].view(-1)[5] = float("inf")
            opt.backward(sum((p.float() * c).sum() for p, c in zip(params, coef)))
        opt.multiply_grads(1.0 / update_freq)
        try:
            norms.append(opt.clip_grad_norm(clip))
        except OverflowError:
            overflows += 1
            continue
        opt.step()
    return overflows, norms


def _worker_entry(rank, world, init_file, backend, worker, args, results, environ):
    import os

    import torch.distributed as dist

    os.environ.clear()  # a forkserver child starts with the server's environment: the caller's
    os.environ.update(environ)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results[rank] = worker(rank, *args)
    finally:
        dist.destroy_process_group()


def run_workers(tmp_path, worker, *args, world=2, backend="gloo"):
    """``worker(rank, *args)`` in ``world`` processes joined by a default process group of
    ``backend`` (nccl: one GPU per rank); the dicts they return, by rank. ``worker`` must be a
    module-level function (it is pickled). Each process gets this process's environment.

    gloo workers start from multiprocessing's forkserver (a fork of a server process that never
    touches CUDA), nccl workers as fresh interpreters (spawn): where the server preloads torch
    (tests/conftest.py), a worker starts in a fraction of a second instead of importing torch
    again. The result dict's manager is a fresh interpreter too: forked from this process, which
    may hold threads, it was seen to abort while collecting garbage."""
    import os

    import torch.multiprocessing as mp

    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _worker_entry, args=(world, str(tmp_path / "rdzv"), backend, worker, args, results,
                                 dict(os.environ)),
            nprocs=world, start_method="spawn" if backend == "nccl" else "forkserver")
        return [results[rank] for rank in range(world)]
