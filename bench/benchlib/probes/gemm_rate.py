"""The fp16 matrix rate of this GPU, now: ``BENCH_GEMM_TFLOPS x`` for an 8192^3 matmul.

Printed beside a call's figures (``env.gemm_tflops``): the baselines measured 72-101k wps at 8192
tokens in different calls, so the machine is one suspect when the figures of two calls disagree.
"""
import torch


def main():
    n, iters = 8192, 200
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    for _ in range(100):  # clocks up, cuBLAS heuristics chosen
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    print("BENCH_GEMM_TFLOPS", 2 * n**3 * iters / (start.elapsed_time(end) * 1e-3) / 1e12)


if __name__ == "__main__":
    main()
