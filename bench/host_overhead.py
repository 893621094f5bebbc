"""Host (CPU) cost vs GPU cost of one training forward+backward, fairseq vs ls_ (big t2t, fp16).

Prints a table per variant and batch: GPU ms per fwd+bwd (CUDA events, queue kept full), host ms
to *issue* the same fwd+bwd while the GPU is held busy by a long ``torch.cuda._sleep`` (so the
host never waits: pure Python + dispatcher + launch cost), and the ops with the most host time
(torch.profiler self CPU time). When host ms > GPU ms the step is host-bound. fairseq's own
model synchronises inside its forward (``encoder_padding_mask.any()``), so for it only the wall
time per step is reported.

    python bench/host_overhead.py --tokens 8192 16384
"""
import argparse
import time

import torch

from ls_fairseq.testing.fairseq_helpers import build_model, make_dictionary, random_batch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss  # noqa: E402

from ls_fairseq import ops  # noqa: E402

ARCH = "transformer_wmt_en_de_big_t2t"


def loss_fn(model, batch, target, pad, fused):
    """fairseq's label-smoothed loss (fp32 log-probs) or the fused ls_ one, summed over tokens."""
    logits, _ = model(*batch)
    logits, target = logits.view(-1, logits.size(-1)), target.view(-1)
    if fused:
        loss, _ = ops.label_smoothed_cross_entropy(logits, target, 0.1, pad)
        return loss
    lprobs = torch.log_softmax(logits.float(), -1)
    loss, _ = label_smoothed_nll_loss(lprobs, target, 0.1, ignore_index=pad)
    return loss


def measure(model, batch, target, pad, fused, iters):
    def step():
        loss = loss_fn(model, batch, target, pad, fused)
        (loss * 128.0).backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # Park the GPU on a sleep kernel (~0.2 s) and issue one step behind it: the host never waits,
    # so the step's wall time is its pure issue cost, and events around the queued step time the
    # GPU work alone (no launch gaps). A step that takes longer than the sleep to issue waited
    # for the GPU (a synchronising call, or a full launch queue).
    host, gpu = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(4e8))
        start.record()
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    synced = max(host) > 150
    gpu_ms, host_ms = sorted(gpu)[iters // 2], sorted(host)[iters // 2]
    if synced:  # neither figure is clean: report wall time per step instead (upper bound)
        t = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        gpu_ms, host_ms = (time.perf_counter() - t) * 1e3 / iters, float("nan")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
    return gpu_ms, host_ms, [(e.key[:60], e.self_cpu_time_total / 2e3, e.count // 2)
                                          for e in top]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--variants", default="fairseq,ls")
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # the best baseline (see docs/PERFORMANCE.md)
    d = make_dictionary(32000)
    pad = d.pad()
    for variant in args.variants.split(","):
        arch = ARCH if variant == "fairseq" else "ls_" + ARCH
        model = build_model(arch, d, ["--share-all-embeddings", "--dropout", "0.3"]).cuda().half()
        model.train()
        for tokens in args.tokens:
            t = 30  # WMT-like mean length
            g = torch.Generator().manual_seed(0)
            src, src_len, prev, tgt = random_batch(d, tokens // t, t, t + 1, generator=g)
            batch = (src.cuda(), src_len.cuda(), prev.cuda())
            gpu_ms, host_ms, top = measure(model, batch, tgt.cuda(), pad,
                                           variant != "fairseq", args.iters)
            if host_ms != host_ms:
                print(f"\n{variant} tokens={tokens}: {gpu_ms:.1f} ms/fwd+bwd wall; the step "
                      f"synchronises with the GPU, so host and GPU time cannot be separated")
            else:
                print(f"\n{variant} tokens={tokens}: GPU {gpu_ms:.1f} ms/fwd+bwd, host {host_ms:.1f} "
                      f"ms to issue it ({'host' if host_ms > gpu_ms else 'GPU'}-bound)")
            print("  top host ops (self CPU ms per step, calls):")
            for name, ms, n in top:
                print(f"    {ms:7.2f}  {n:5d}  {name}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
