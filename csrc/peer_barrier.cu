// A barrier between the GPUs of one host through peer memory, for the copy-engine all-reduce
// (ls_fairseq/graphs/peer_all_reduce.py, LS_FAIRSEQ_PEER_BARRIER=flags). Semantics and the
// reference of what it leaves behind: ls_fairseq/ops/peer_barrier.py.
//
// peer_barrier_(flags, peer_flags, rank, epoch): one block. Thread j stands for the j-th other
// rank q: it writes `epoch` into slot `rank` of q's flags (peer_flags[j], mapped here by CUDA
// IPC), with release semantics at system scope, then waits until slot q of this rank's own
// `flags` holds `epoch` or more (acquire, system scope). The kernel ends when every other rank has
// signalled: everything those ranks queued before their own barrier (their copies into this
// rank's memory included: a copy completes before the next kernel of its stream starts) is then
// visible to the kernels this rank queues after it. A rank that never arrives would hold the
// kernel for good: after kTimeoutSeconds it prints which rank it waited for and traps (the
// process then fails with a CUDA error, as NCCL's watchdog ends a hung collective).
#include <cuda/atomic>

#include <torch/library.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "check.h"

namespace {

constexpr int kMaxWorld = 32;  // one warp: a thread per other rank
constexpr unsigned long long kTimeoutSeconds = 600;

struct PeerFlags {
  long long* p[kMaxWorld - 1];
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void peer_barrier_kernel(long long* flags, PeerFlags peers, int rank, int world,
                                    long long epoch) {
  const int j = threadIdx.x;
  if (j >= world - 1) return;
  const int q = j < rank ? j : j + 1;
  __threadfence_system();  // this rank's earlier writes before the signal
  cuda::atomic_ref<long long, cuda::thread_scope_system> signal(peers.p[j][rank]);
  signal.store(epoch, cuda::memory_order_release);
  cuda::atomic_ref<long long, cuda::thread_scope_system> mine(flags[q]);
  const unsigned long long start = global_ns();
  while (mine.load(cuda::memory_order_acquire) < epoch) {
    __nanosleep(64);
    if (global_ns() - start > kTimeoutSeconds * 1000000000ull) {
      printf("ls_fairseq peer_barrier: rank %d waited %llu s for rank %d (barrier %lld)\n", rank,
             kTimeoutSeconds, q, epoch);
      __trap();
    }
  }
}

void peer_barrier_(at::Tensor flags, at::TensorList peer_flags, int64_t rank, int64_t epoch) {
  const int64_t world = static_cast<int64_t>(peer_flags.size()) + 1;
  LSF_CHECK(world <= kMaxWorld, "peer_barrier_: at most ", kMaxWorld, " ranks, got ", world);
  LSF_CHECK(flags.is_cuda() && flags.is_contiguous() && flags.scalar_type() == at::kLong &&
                flags.numel() == world,
            "peer_barrier_: flags must be a contiguous int64 CUDA tensor of world size (", world,
            ")");
  LSF_CHECK(0 <= rank && rank < world, "peer_barrier_: rank ", rank, " outside 0..", world - 1);
  LSF_CHECK(epoch > 0, "peer_barrier_: epoch must be positive, got ", epoch);
  PeerFlags peers{};
  for (int64_t j = 0; j + 1 < world; ++j) {
    const auto& p = peer_flags[j];
    LSF_CHECK(p.is_cuda() && p.is_contiguous() && p.scalar_type() == at::kLong &&
                  p.numel() >= world && p.device() == flags.device(),
              "peer_barrier_: every peer's flags must be a contiguous int64 tensor of world size "
              "(", world, ") on flags' device (", flags.device(), ")");
    peers.p[j] = static_cast<long long*>(p.data_ptr());
  }
  if (world == 1) return;
  c10::cuda::CUDAGuard guard(flags.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flags.device().index());
  peer_barrier_kernel<<<1, 32, 0, stream>>>(static_cast<long long*>(flags.data_ptr()), peers,
                                            static_cast<int>(rank), static_cast<int>(world),
                                            static_cast<long long>(epoch));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("peer_barrier_(Tensor(a!) flags, Tensor(b!)[] peer_flags, int rank, int epoch) -> ()");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) { m.impl("peer_barrier_", &peer_barrier_); }
