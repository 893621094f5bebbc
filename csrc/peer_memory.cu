// Another process's GPU memory, mapped into this one (CUDA IPC), for the copy-engine all-reduce
// (ls_fairseq/graphs/peer_all_reduce.py). Host code only.
//
// peer_export(t): a CPU uint8 tensor of kExportBytes: the IPC handle of the allocation that
//   holds t (the caching allocator's segment: cudaIpcGetMemHandle wants the base of a cudaMalloc),
//   t's byte offset in it and the segment's size.
// peer_import(exported, device, nbytes): that whole segment (nbytes: its size, as exported),
//   opened in this process on `device` (a uint8 CUDA tensor on this process's device, backed by
//   the other GPU's memory through peer access), so that copies into it are device-to-device
//   copies the copy engines carry over NVLink. The mapping is closed when the tensor's storage
//   is freed. Open each segment once per process.
//
// Neither is differentiable; their fakes (ops/_peer_memory_cuda.py) give the shapes only.
#include <cstring>

#include <torch/library.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "check.h"

namespace {

constexpr int64_t kHandleBytes = sizeof(cudaIpcMemHandle_t);
constexpr int64_t kExportBytes = kHandleBytes + 2 * sizeof(int64_t);

at::Tensor peer_export(const at::Tensor& t) {
  LSF_CHECK(t.is_cuda(), "peer_export: expected a CUDA tensor, got one on ", t.device());
  c10::cuda::CUDAGuard guard(t.device());
  size_t segment = 0;
  void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(t.data_ptr(), &segment);
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
  at::Tensor out = at::empty({kExportBytes}, at::TensorOptions().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t offset = static_cast<char*>(t.data_ptr()) - static_cast<char*>(base);
  const int64_t size = static_cast<int64_t>(segment);
  std::memcpy(o, &handle, kHandleBytes);
  std::memcpy(o + kHandleBytes, &offset, sizeof(int64_t));
  std::memcpy(o + kHandleBytes + sizeof(int64_t), &size, sizeof(int64_t));
  return out;
}

at::Tensor peer_import(const at::Tensor& exported, int64_t device, int64_t nbytes) {
  LSF_CHECK(exported.device().is_cpu() && exported.scalar_type() == at::kByte &&
                exported.numel() == kExportBytes && exported.is_contiguous(),
            "peer_import: expected what peer_export returned (", kExportBytes,
            " bytes on the CPU)");
  const uint8_t* e = exported.data_ptr<uint8_t>();
  cudaIpcMemHandle_t handle;
  int64_t size = 0;
  std::memcpy(&handle, e, kHandleBytes);
  std::memcpy(&size, e + kHandleBytes + sizeof(int64_t), sizeof(int64_t));
  LSF_CHECK(size == nbytes, "peer_import: nbytes (", nbytes, ") is not the exported size (", size,
            ")");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
  return at::from_blob(
      ptr, {size}, [](void* p) { cudaIpcCloseMemHandle(p); },
      at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("peer_export(Tensor t) -> Tensor");
  m.def("peer_import(Tensor exported, int device, int nbytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) { m.impl("peer_export", &peer_export); }
TORCH_LIBRARY_IMPL(ls_fairseq, CPU, m) { m.impl("peer_import", &peer_import); }
