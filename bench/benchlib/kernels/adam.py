"""Benchmark: one Adam step over a Transformer-big sized model (~218M parameters, ~200 tensors).

Kernel-only rows (median of CUDA-event times of ``adam_step_cuda``):
  * ``fused fp16 copy``: fp32 master + moments, fp16 grads read from the model, fp16 weights
    written (``--fp16 --ls-fused-fp16-copy``): 28 bytes/parameter, the bandwidth floor's case;
  * ``flat fp32``: the step on fairseq's flat fp32 master and flat fp32 grads (``--fp16`` with
    ls_adam, without the copy loops): 28 bytes/parameter;
  * ``mem-eff fp16``: fp16 weights + grads, fp32 moments (``--memory-efficient-fp16``): 22 B/p;
  * ``fp16 stats``: fp32 master + grads, fp16 moments with scales: a statistics pass (reads
    g, m, v: 8 B) then the update (20 B): 28 bytes/parameter in two launches.
Whole optimizer phase as fairseq's trainer runs it (``multiply_grads``, ``clip_grad_norm`` and
``step`` of the real ``FP16Optimizer``; host timer around, synchronized), with fairseq's adam,
with ls_adam, and with ls_adam ``--ls-fused-fp16-copy`` (``LSFusedFP16Optimizer``).

The floor is 28 bytes/parameter over the copy bandwidth measured on the same GPU (a large
device-to-device copy, bytes read + written). Usage: python bench/kernels.py adam [--reps 20]
"""
import argparse
import statistics
import time

import torch

from ls_fairseq.ops import _extension

HYPER = dict(lr=5e-4, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.0001)


def transformer_big_shapes(vocab=40000, d=1024, ffn=4096, layers=6):
    shapes = [(vocab, d)]  # shared embedding / output projection
    attn = [(d, d), (d,)] * 4
    ln = [(d,), (d,)]
    for _ in range(layers):  # encoder
        shapes += attn + ln + [(ffn, d), (ffn,), (d, ffn), (d,)] + ln
    for _ in range(layers):  # decoder
        shapes += attn + ln + attn + ln + [(ffn, d), (ffn,), (d, ffn), (d,)] + ln
    shapes += ln + ln  # final layer norms
    return shapes


def copy_bandwidth():
    n = 1 << 28  # 1 GiB of fp32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return 2 * n * 4 / (statistics.median(ts) * 1e-3)


def time_events(fn, reps):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def time_host(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def kernel_rows(shapes, reps):
    from ls_fairseq.ops.adam import adam_step_cuda

    numel = [torch.Size(s).numel() for s in shapes]
    total = sum(numel)
    flat = torch.randn(total, device="cuda") * 0.02
    m = torch.zeros(total, device="cuda")
    v = torch.zeros(total, device="cuda")
    fp16_params = [torch.empty(s, device="cuda", dtype=torch.float16) for s in shapes]
    fp16_grads = [torch.randn(s, device="cuda").half() for s in shapes]
    views = lambda t: list(t.split(numel))  # noqa: E731
    masters, ms, vs = views(flat), views(m), views(v)
    copies = [p.view(-1) for p in fp16_params]
    grads16 = [g.view(-1) for g in fp16_grads]
    flat_grad = torch.randn(total, device="cuda")
    step = [0]

    def nxt():
        step[0] += 1
        return step[0]

    rows = {}
    rows["fused fp16 copy"] = (time_events(lambda: adam_step_cuda(
        masters, grads16, ms, vs, step=nxt(), grad_scale=1 / 128, model_copies=copies,
        **HYPER), reps), 28)
    rows["flat fp32"] = (time_events(lambda: adam_step_cuda(
        [flat], [flat_grad], [m], [v], step=nxt(), grad_scale=1 / 128, **HYPER), reps), 28)
    m16, v16 = m.half(), v.abs().half()
    scales = torch.ones(1, 2, device="cuda")
    rows["fp16 stats (2 passes)"] = (time_events(lambda: adam_step_cuda(
        [flat], [flat_grad], [m16], [v16], step=nxt(), moment_scales=scales, **HYPER), reps),
        28)
    del m16, v16, flat_grad
    p16 = [p.normal_() for p in fp16_params]
    mm = [torch.zeros_like(p, dtype=torch.float32) for p in p16]
    vv = [torch.zeros_like(p, dtype=torch.float32) for p in p16]
    rows["mem-eff fp16"] = (time_events(lambda: adam_step_cuda(
        p16, fp16_grads, mm, vv, step=nxt(), **HYPER), reps), 22)
    return total, rows


def _fairseq_cfg(optimizer, extra=()):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import ls_fairseq  # noqa: F401  (registers ls_adam)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        "/nonexistent", "--arch", "transformer", "--task", "translation", "--optimizer",
        optimizer, "--lr", "5e-4", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.0001",
        "--fp16", "--fp16-init-scale", "128", "--clip-norm", "0.0", *extra])
    return convert_namespace_to_omegaconf(args)


def optimizer_rows(shapes, reps):
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    rows = {}
    for name, opt_name, extra in [("fairseq FP16Optimizer + adam", "adam", []),
                                  ("FP16Optimizer + ls_adam", "ls_adam", []),
                                  ("ls_adam --ls-fused-fp16-copy", "ls_adam",
                                   ["--ls-fused-fp16-copy"])]:
        params = [torch.nn.Parameter(torch.randn(s, device="cuda").half() * 0.02)
                  for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = FP16Optimizer.build_optimizer(_fairseq_cfg(opt_name, extra), params)

        def phase():  # what trainer.train_step does after the backward passes
            opt._needs_sync = True
            opt._multiply_factor = 1.0 / 128
            opt.multiply_grads(1.0 / 4096)
            opt.clip_grad_norm(0.0)
            opt.step()

        rows[name] = time_host(phase, reps)
        del opt, params
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kernels.py adam", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    assert _extension.load(), _extension.failure_reason()
    shapes = transformer_big_shapes()
    bw = copy_bandwidth()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    total, rows = kernel_rows(shapes, args.reps)
    print(f"\nAdam step, {total / 1e6:.1f}M parameters in {len(shapes)} tensors; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'variant':<28} {'B/param':>7} {'ms':>7} {'floor ms':>8} {'% of floor':>10}")
    for name, (ms, bpp) in rows.items():
        floor = bpp * total / bw * 1e3
        print(f"{name:<28} {bpp:>7} {ms:>7.3f} {floor:>8.3f} {100 * floor / ms:>9.0f}%")
    orows = optimizer_rows(shapes, max(5, args.reps // 2))
    floor28 = 28 * total / bw * 1e3
    print("\nWhole optimizer phase (multiply_grads + clip_grad_norm + step, host-timed, "
          "includes the grad-norm pass and Python)")
    print(f"{'optimizer':<32} {'ms':>8} {'vs fairseq':>10} {'floor(28B) ms':>13}")
    base = orows["fairseq FP16Optimizer + adam"]
    for name, ms in orows.items():
        print(f"{name:<32} {ms:>8.3f} {base / ms:>9.1f}x {floor28:>13.3f}")


if __name__ == "__main__":
    main()
