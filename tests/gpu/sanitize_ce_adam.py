"""Small CE + Adam workload for ``compute-sanitizer --tool memcheck`` (not a pytest module).

Odd vocabularies, misaligned rows, padding, in-place and out-of-place backward; Adam over odd
sizes and misaligned views, every storage variant, fp16 stats. Exits non-zero on a wrong result
so a sanitizer run also checks that the kernels ran.
    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/gpu/sanitize_ce_adam.py
"""
import torch

from ls_fairseq.ops import _extension
from ls_fairseq.ops._adam_cuda import adam_step_cuda
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference

assert _extension.load(), _extension.failure_reason()
ops = torch.ops.ls_fairseq
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    for v in (2, 7, 33, 1001):
        for off in (0, 1, 3):
            n = 13
            buf = torch.randn(n * v + off, device="cuda").to(dtype)
            x = buf[off:].view(n, v)
            t = torch.randint(0, v, (n,), device="cuda")
            t[::4] = 1 % v
            loss, nll, lse, am = ops.ls_cross_entropy_fwd(x, t, 0.1, 1 % v, True)
            ref, _ = label_smoothed_cross_entropy_reference(x, t, 0.1, 1 % v)
            assert abs(loss.sum().item() - ref.item()) <= 1e-3 * (1 + abs(ref.item())), (dtype, v)
            g = torch.ones(1, device="cuda")
            out = ops.ls_cross_entropy_bwd(g, None, x, t, lse, 0.1, 1 % v)
            ops.ls_cross_entropy_bwd_(g, None, x, t, lse, 0.1, 1 % v)
            assert torch.equal(out, x)
sizes = [1, 3, 4, 5, 17, 1025, 16385, 40001]
for pt, gt, mt, ot in [(torch.float32, torch.float32, torch.float32, None),
                       (torch.float16, torch.float16, torch.float32, None),
                       (torch.float32, torch.float16, torch.float32, torch.float16),
                       (torch.float32, torch.float32, torch.float16, None)]:
    for off in (0, 1, 4):  # vector (aligned), element-by-element, vector (16-byte aligned)
        mk = lambda dt: [torch.randn(n + off, device="cuda").to(dt)[off:] for n in sizes]  # noqa
        ps, gs, ms, vs = mk(pt), mk(gt), mk(mt), [x.abs() for x in mk(mt)]
        outs = mk(ot) if ot is not None else None
        f = adam_step_cuda(ps, gs, ms, vs, lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8,
                           weight_decay=0.01, step=2, model_copies=outs)
        assert f.item() == 0
        if mt == torch.float16:
            sc = torch.ones(len(sizes), 2, device="cuda")
            adam_step_cuda(ps, gs, ms, vs, lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8,
                           weight_decay=0.0, step=3, moment_scales=sc)
torch.cuda.synchronize()
print("sanitize workload OK")
