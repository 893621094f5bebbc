#!/usr/bin/env python3
"""Would cuBLASLt's epilogues shorten the backward? GPU time of every algorithm cuBLASLt's
heuristic offers (up to 8) for the GEMMs of transformer big's backward with and without the
epilogue that would replace a separate bandwidth-bound kernel (H100/H200 figures and the decision
in docs/PERFORMANCE.md, "Components"):

* fc2's input gradient (grad [N, 1024] @ W2 [1024, 4096]) plain, with DRELU (the relu/dropout
  backward folded in through a bit-mask) and with DRELU_BGRAD (also fc1's bias gradient);
* a projection's weight gradient (grad^T [out, N] @ x [N, 1024]) plain and with BGRADB (its bias
  gradient folded in), for the packed QKV (out 3072) and the layer-batched encoder K/V (12288);
* the separate kernels they would replace: aten's ``sum(0)`` (the bias gradient) and ``torch.mm``.

Standalone (compiles a small cuBLASLt caller with torch's inline extension builder); the project
itself does not call cuBLASLt.

    python bench/cublaslt_epilogues.py
"""
import torch
from torch.utils.cpp_extension import load_inline

from timing import cuda_event_ms  # noqa: E402

SOURCE = r'''
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <vector>
// ms per call of each heuristic algorithm for D (m x n, column-major) = op(A) op(B), fp16 in and
// out, fp32 compute, with epilogue `epi` (bias / aux pointers as that epilogue needs them).
std::vector<double> time_algos(int64_t epi, int64_t m, int64_t n, int64_t k, bool ta, bool tb,
    at::Tensor A, at::Tensor B, at::Tensor D, at::Tensor bias, at::Tensor aux, int64_t aux_ld, int64_t reps) {
  cublasLtMatmulDesc_t op; cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasOperation_t a = ta ? CUBLAS_OP_T : CUBLAS_OP_N, b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &a, sizeof(a));
  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &b, sizeof(b));
  uint32_t e = (uint32_t)epi; cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e));
  void* bp = bias.numel() ? bias.data_ptr() : nullptr; void* xp = aux.numel() ? aux.data_ptr() : nullptr;
  if (bp) cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp));
  if (xp) { cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &xp, sizeof(xp));
            cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)); }
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16F, ta ? k : m, ta ? m : k, ta ? k : m);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16F, tb ? n : k, tb ? k : n, tb ? n : k);
  cublasLtMatrixLayoutCreate(&ld, CUDA_R_16F, m, n, m);
  cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
  uint64_t ws = 32ull << 20; cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t res[16]; int found = 0;
  auto h = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 16, res, &found);
  auto wsT = at::empty({(int64_t)ws}, A.options().dtype(at::kByte));
  std::vector<double> out; float alpha = 1.f, beta = 0.f; auto s = c10::cuda::getCurrentCUDAStream();
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int i = 0; i < found; ++i) {
    auto call = [&] {
      cublasLtMatmul(h, op, &alpha, A.data_ptr(), la, B.data_ptr(), lb, &beta, D.data_ptr(), ld,
                     D.data_ptr(), ld, &res[i].algo, wsT.data_ptr(), ws, s);
    };
    for (int w = 0; w < 3; ++w) call();
    cudaEventRecord(e0, s);
    for (int r = 0; r < reps; ++r) call();
    cudaEventRecord(e1, s); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); out.push_back(ms / reps);
  }
  return out;
}
'''
# cublasLtEpilogue_t values (cublasLt.h)
DEFAULT, DRELU, DRELU_BGRAD, BGRADB = 1, 8 | 128, 8 | 128 | 16, 512


def aten_ms(fn):
    return cuda_event_ms(fn, 20)


def main():
    mod = load_inline("ls_bench_cublaslt_epilogues", cpp_sources=[SOURCE], functions=["time_algos"],
                      extra_ldflags=["-lcublasLt"], with_cuda=True, verbose=False)
    half = dict(device="cuda", dtype=torch.float16)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| tokens | GEMM | epilogue | algorithms | best ms | heuristic's first ms |")
    print("|---:|---|---|---:|---:|---:|")

    def row(n, what, epi, times):
        best = f"{min(times):.4f}" if times else "-"
        first = f"{times[0]:.4f}" if times else "-"
        print(f"| {n} | {what} | {epi} | {len(times)} | {best} | {first} |", flush=True)

    for n in (7552, 65536):
        f, d = 4096, 1024
        w2, g, gx = torch.randn(d, f, **half), torch.randn(n, d, **half), torch.empty(n, f, **half)
        mask = torch.randint(0, 256, (n, f // 8), device="cuda", dtype=torch.uint8)
        bias, none = torch.empty(f, **half), torch.empty(0, **half)
        for name, epi, b, aux in [("DEFAULT", DEFAULT, none, mask[:0]), ("DRELU", DRELU, none, mask),
                                  ("DRELU_BGRAD", DRELU_BGRAD, bias, mask)]:
            row(n, "fc2 input grad [N,1024]x[1024,4096]", name,
                mod.time_algos(epi, f, n, d, False, False, w2, g, gx, b, aux, f, 20))
        print(f"| {n} | fc2 input grad | torch.mm | – | {aten_ms(lambda: torch.mm(g, w2)):.4f} | – |")
        for out_f in (3072, 12288):
            x, gy = torch.randn(n, d, **half), torch.randn(n, out_f, **half)
            gw, gb = torch.empty(out_f, d, **half), torch.empty(out_f, **half)
            for name, epi, b in [("DEFAULT", DEFAULT, none), ("BGRADB", BGRADB, gb)]:
                row(n, f"weight grad [{out_f},N]x[N,1024]", name,
                    mod.time_algos(epi, d, out_f, n, False, True, x, gy, gw, b, mask[:0], 0, 20))
            print(f"| {n} | bias grad [N,{out_f}] | aten sum(0) | – | "
                  f"{aten_ms(lambda: gy.sum(0)):.4f} | – |")


if __name__ == "__main__":
    main()
