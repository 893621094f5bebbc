// FP8 per-tensor current scaling for ls_fairseq/ops/fp8_linear.py (--ls-fp8), in two passes:
//
//   fp8_quantize(t [R, C], dtype, transpose_pad) -> (t8 [R, C], inv_scale [], t8T [C, R'] or [0])
//     pass 1: amax(|t|), one partial per block (no atomics, nothing to zero first);
//     pass 2: every block reduces the partials, then
//       scale     = fp8_max * reciprocal(max(amax, 1e-12))
//       t8        = to_fp8(clamp(float(t) * scale, -fp8_max, fp8_max))
//       inv_scale = reciprocal(scale)
//     and, for transpose_pad > 0, the transposed copy t8T [C, R'] (R' = R rounded up to
//     transpose_pad, columns R.. zero) from the same registers, through shared memory.
//   fp8_transpose(t8 [R, C], pad) -> [C, R']: the transposed copy alone, of any 1-byte dtype.
//
// Bit for bit the PyTorch reference (fp8_linear.quantize / transposed) on the GPU:
//   * amax: the max of the bits of |float(t)|; for non-negative floats the unsigned order is
//     NaN > inf > finite, so a NaN anywhere gives a NaN amax, as torch.amax does;
//   * scale: `fp8_max / amax_tensor` in Python is Tensor.__rtruediv__, i.e.
//     `amax.reciprocal() * fp8_max`: two float32 roundings, not one division. The extension builds
//     without fast math (ls_fairseq/ops/_extension.py CUDA_FLAGS), and __fdiv_rn / __fmul_rn are
//     the IEEE operations torch's reciprocal and mul kernels run;
//   * clamp: torch's clamp kernel (NaN passes through, then min(max(v, lo), hi));
//   * cast: c10's own float -> float8 conversion (the one torch's copy kernel runs). For the
//     values reaching it (clamped, and NaNs canonical 0x7fffffff after the multiply) it equals
//     __nv_cvt_float_to_fp8's round-to-nearest-even, ±0, subnormals and ties included.
// No host synchronisation: CUDA-graph capturable. Launches on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "check.h"
#include "device_utils.cuh"
#include "launch_utils.h"

namespace {

using namespace lsf;  // helpers from device_utils.cuh / launch_utils.h

constexpr int kAmaxThreads = 512;
constexpr int kThreads = 256;   // pass 2 (elementwise and tiles)
constexpr int kTile = 64;       // tile of the transposing pass: 64 x 64 elements
constexpr int kBlocksPerSm = 8;  // pass 2 grid cap: each block re-reads the amax partials

// ---------------------------------------------------------------- scale
enum class Fp8 { kE4M3, kE5M2 };

template <Fp8 F>
__device__ __forceinline__ float fp8_max() {
  return F == Fp8::kE5M2 ? 57344.f : 448.f;
}

template <Fp8 F>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  if constexpr (F == Fp8::kE5M2) {
    return c10::detail::fp8e5m2_from_fp32_value(v);
  } else {
    return c10::detail::fp8e4m3fn_from_fp32_value(v);
  }
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ uint32_t umax32(uint32_t a, uint32_t b) { return a > b ? a : b; }

// The block's max of m, in every thread. Uses a 32-word shared buffer; callable repeatedly.
__device__ __forceinline__ uint32_t block_max(uint32_t m) {
  __shared__ uint32_t warp_max[32];
  __shared__ uint32_t result;
  for (int off = 16; off > 0; off >>= 1) m = umax32(m, __shfl_xor_sync(0xffffffffu, m, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = (blockDim.x + 31) / 32;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? warp_max[lane] : 0u;
    for (int off = 16; off > 0; off >>= 1) m = umax32(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) result = m;
  }
  __syncthreads();
  return result;
}

// scale = fp8_max * (1 / clamp_min(amax, AMAX_FLOOR)), as the reference's tensor ops round it.
template <Fp8 F>
__device__ __forceinline__ float scale_from_amax(uint32_t amax_bits) {
  const float amax = __uint_as_float(amax_bits);
  const float floor = static_cast<float>(1e-12);  // fp8_linear.AMAX_FLOOR, as Scalar -> float
  const float clamped = isnan(amax) ? amax : fmaxf(amax, floor);
  return __fmul_rn(__fdiv_rn(1.0f, clamped), fp8_max<F>());
}

// Every block: the amax from pass 1's partials and the scale; block 0 writes inv_scale.
template <Fp8 F>
__device__ __forceinline__ float block_scale(const uint32_t* __restrict__ partials, int nparts,
                                             float* __restrict__ inv_scale) {
  uint32_t m = 0u;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) m = umax32(m, partials[i]);
  const float scale = scale_from_amax<F>(block_max(m));
  if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = __fdiv_rn(1.0f, scale);
  return scale;
}

template <Fp8 F>
__device__ __forceinline__ uint8_t quantize_one(float x, float scale) {
  float v = __fmul_rn(x, scale);  // never contracted into anything else
  const float lim = fp8_max<F>();
  v = isnan(v) ? v : fminf(fmaxf(v, -lim), lim);
  return to_fp8<F>(v);
}

// ---------------------------------------------------------------- pass 1: amax partials
template <typename T, bool kVec>
__global__ void __launch_bounds__(kAmaxThreads)
    amax_kernel(const T* __restrict__ in, int64_t n, uint32_t* __restrict__ partials) {
  constexpr int V = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t m = 0u;
  int64_t tail = 0;
  if constexpr (kVec) {
    const int64_t nv = n / V;
    const Pack<T, V>* vin = reinterpret_cast<const Pack<T, V>*>(in);
    int64_t i = first;
    for (; i + 3 * stride < nv; i += 4 * stride) {  // four 16-byte loads in flight per thread
      Pack<T, V> p[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) p[u] = vin[i + u * stride];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int k = 0; k < V; ++k) m = umax32(m, abs_bits(to_float(p[u].v[k])));
    }
    for (; i < nv; i += stride) {
      const Pack<T, V> p = vin[i];
#pragma unroll
      for (int k = 0; k < V; ++k) m = umax32(m, abs_bits(to_float(p.v[k])));
    }
    tail = nv * V;
  }
  for (int64_t i = tail + first; i < n; i += stride) m = umax32(m, abs_bits(to_float(in[i])));
  m = block_max(m);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// ---------------------------------------------------------------- pass 2: t8 only
template <typename T, Fp8 F, bool kVec>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, int64_t n,
                    const uint32_t* __restrict__ partials, int nparts,
                    float* __restrict__ inv_scale) {
  constexpr int V = 16 / sizeof(T);
  const float scale = block_scale<F>(partials, nparts, inv_scale);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if constexpr (kVec) {
    const int64_t nv = n / V;
    for (int64_t i = first; i < nv; i += stride) {
      const Pack<T, V> p = reinterpret_cast<const Pack<T, V>*>(in)[i];
      Pack<uint8_t, V> q;
#pragma unroll
      for (int k = 0; k < V; ++k) q.v[k] = quantize_one<F>(to_float(p.v[k]), scale);
      reinterpret_cast<Pack<uint8_t, V>*>(out)[i] = q;
    }
    tail = nv * V;
  }
  for (int64_t i = tail + first; i < n; i += stride)
    out[i] = quantize_one<F>(to_float(in[i]), scale);
}

// ---------------------------------------------------------------- pass 2: tiles, with t8T
struct TileShape {
  int64_t rows, cols, padded_rows;  // R, C, R'
  int64_t col_tiles, tiles;
};

// Four columns c..c+3 of one row (zero past the row's end), as float8 bytes: quantized from T,
// or copied (In = uint8_t, kQuant false).
template <typename In, bool kQuant, Fp8 F>
__device__ __forceinline__ void load_four(const In* __restrict__ row, int64_t c, int64_t cols,
                                          bool vec, float scale, uint8_t (&q)[4]) {
  if (vec) {  // cols % 4 == 0 and the row 4-element aligned: c..c+3 all inside or all outside
    if (c < cols) {
      const Pack<In, 4> p = *reinterpret_cast<const Pack<In, 4>*>(row + c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (kQuant) {
          q[i] = quantize_one<F>(to_float(p.v[i]), scale);
        } else {
          q[i] = p.v[i];
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = 0;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (c + i < cols) {
        if constexpr (kQuant) {
          q[i] = quantize_one<F>(to_float(row[c + i]), scale);
        } else {
          q[i] = row[c + i];
        }
      } else {
        q[i] = 0;
      }
    }
  }
}

// One 64 x 64 tile per step (grid-stride over tiles). Thread (tx, ty) of 16 x 16 loads the 4 x 4
// block rows 4ty.., columns 4tx.. (coalesced rows), writes its t8 bytes (out8, when not null),
// and leaves the block transposed in shared memory: word [column][row / 4] holds 4 rows' bytes.
// Then thread k writes 16 bytes (rows 16 (k % 4).., column k / 4) of the transposed tile, one
// 16-byte store per thread when R' is a multiple of 16. Rows R..R'-1 of the tile are zero.
template <typename In, bool kQuant, Fp8 F>
__global__ void __launch_bounds__(kThreads)
    tile_kernel(const In* __restrict__ in, uint8_t* __restrict__ out8, uint8_t* __restrict__ outT,
                TileShape s, bool vec_in, bool vec_out, const uint32_t* __restrict__ partials,
                int nparts, float* __restrict__ inv_scale) {
  __shared__ uint32_t tile[kTile][kTile / 4 + 1];
  float scale = 0.f;
  if constexpr (kQuant) scale = block_scale<F>(partials, nparts, inv_scale);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int col = threadIdx.x / 4, part = threadIdx.x % 4;
  for (int64_t t = blockIdx.x; t < s.tiles; t += gridDim.x) {
    const int64_t r0 = (t / s.col_tiles) * kTile, c0 = (t % s.col_tiles) * kTile;
    const int64_t c = c0 + 4 * tx;
    uint32_t word[4] = {0u, 0u, 0u, 0u};  // word[i]: column c + i, rows 4ty..4ty+3 (byte j: row j)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t r = r0 + 4 * ty + j;
      if (r < s.rows) {
        uint8_t q[4];
        load_four<In, kQuant, F>(in + r * s.cols, c, s.cols, vec_in, scale, q);
        if (out8 != nullptr) {
          uint8_t* dst = out8 + r * s.cols;
          if (vec_in) {
            if (c < s.cols) {
              *reinterpret_cast<uint32_t*>(dst + c) =
                  q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
            }
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i)
              if (c + i < s.cols) dst[c + i] = q[i];
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) word[i] |= static_cast<uint32_t>(q[i]) << (8 * j);
      }
    }
    __syncthreads();  // the previous tile's reads of `tile` are done
#pragma unroll
    for (int i = 0; i < 4; ++i) tile[4 * tx + i][ty] = word[i];
    __syncthreads();
    const int64_t oc = c0 + col, orow = r0 + 16 * part;
    if (oc < s.cols && orow < s.padded_rows) {
      const uint4 v = make_uint4(tile[col][4 * part], tile[col][4 * part + 1],
                                 tile[col][4 * part + 2], tile[col][4 * part + 3]);
      uint8_t* dst = outT + oc * s.padded_rows + orow;
      if (vec_out) {
        *reinterpret_cast<uint4*>(dst) = v;
      } else {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int b = 0; b < 16; ++b)
          if (orow + b < s.padded_rows) dst[b] = static_cast<uint8_t>(w[b / 4] >> (8 * (b % 4)));
      }
    }
  }
}

// ---------------------------------------------------------------- host side
bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int64_t padded(int64_t rows, int64_t multiple) {
  return (rows + multiple - 1) / multiple * multiple;
}

unsigned capped_grid(int64_t work, int64_t per_block, int64_t cap) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, cap)));
}

TileShape tile_shape(int64_t rows, int64_t cols, int64_t padded_rows) {
  TileShape s;
  s.rows = rows;
  s.cols = cols;
  s.padded_rows = padded_rows;
  s.col_tiles = (cols + kTile - 1) / kTile;
  s.tiles = s.col_tiles * ((padded_rows + kTile - 1) / kTile);
  return s;
}

template <typename T, Fp8 F>
void launch_quantize(const at::Tensor& t, at::Tensor& t8, at::Tensor& inv, at::Tensor& t8t,
                     int64_t transpose_pad) {
  const int64_t rows = t.size(0), cols = t.size(1), n = t.numel();
  const T* in = reinterpret_cast<const T*>(t.data_ptr());
  uint8_t* out8 = reinterpret_cast<uint8_t*>(t8.data_ptr());
  float* inv_p = inv.data_ptr<float>();
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int sms = sm_count(t.get_device());
  constexpr int V = 16 / sizeof(T);
  const bool vec = aligned(in, 16);

  // pass 1 (none for an empty t: its amax is 0, as the reference's)
  int nparts = 0;
  at::Tensor partials;
  if (n > 0) {
    nparts = static_cast<int>(capped_grid(vec ? n / V + 1 : n, kAmaxThreads, 2 * sms));
    partials = at::empty({nparts}, t.options().dtype(at::kInt));
    uint32_t* pp = reinterpret_cast<uint32_t*>(partials.data_ptr());
    if (vec) {
      amax_kernel<T, true><<<nparts, kAmaxThreads, 0, stream>>>(in, n, pp);
    } else {
      amax_kernel<T, false><<<nparts, kAmaxThreads, 0, stream>>>(in, n, pp);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const uint32_t* pp =
      nparts > 0 ? reinterpret_cast<const uint32_t*>(partials.data_ptr()) : nullptr;

  // pass 2. An empty t still gets its inv_scale (one block); its transposed copy is empty too.
  if (transpose_pad == 0 || n == 0) {
    const unsigned grid = capped_grid(vec ? n / V + 1 : n, kThreads, kBlocksPerSm * sms);
    if (vec) {
      quantize_kernel<T, F, true><<<grid, kThreads, 0, stream>>>(in, out8, n, pp, nparts, inv_p);
    } else {
      quantize_kernel<T, F, false><<<grid, kThreads, 0, stream>>>(in, out8, n, pp, nparts, inv_p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const TileShape s = tile_shape(rows, cols, t8t.size(1));
  const bool vec_in = cols % 4 == 0 && aligned(in, 4 * sizeof(T));
  const bool vec_out = s.padded_rows % 16 == 0;  // every 16-byte chunk aligned (fresh buffer)
  const unsigned grid = capped_grid(s.tiles, 1, kBlocksPerSm * sms);
  tile_kernel<T, true, F><<<grid, kThreads, 0, stream>>>(
      in, out8, reinterpret_cast<uint8_t*>(t8t.data_ptr()), s, vec_in, vec_out, pp, nparts, inv_p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_quantize(const at::Tensor& t_in,
                                                            at::ScalarType dtype,
                                                            int64_t transpose_pad) {
  const char* name = "ls_fairseq fp8_quantize";
  LSF_CHECK(t_in.is_cuda() && t_in.dim() == 2, name, ": t must be a 2-D CUDA tensor, got ",
            t_in.sizes());
  LSF_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, name,
            ": dtype must be float8_e4m3fn or float8_e5m2, got ", dtype);
  LSF_CHECK(transpose_pad >= 0, name, ": transpose_pad must be >= 0 (0: no transposed copy), got ",
            transpose_pad);
  c10::cuda::CUDAGuard guard(t_in.device());
  const at::Tensor t = t_in.contiguous();
  const int64_t rows = t.size(0), cols = t.size(1);
  const auto fp8 = t.options().dtype(dtype);
  at::Tensor t8 = at::empty({rows, cols}, fp8);
  at::Tensor inv = at::empty({}, t.options().dtype(at::kFloat));
  at::Tensor t8t = transpose_pad > 0 ? at::empty({cols, padded(rows, transpose_pad)}, fp8)
                                     : at::empty({0}, fp8);
  LSF_DISPATCH_FLOAT_TYPES(t.scalar_type(), name, [&] {
    if (dtype == at::kFloat8_e5m2) {
      launch_quantize<T, Fp8::kE5M2>(t, t8, inv, t8t, transpose_pad);
    } else {
      launch_quantize<T, Fp8::kE4M3>(t, t8, inv, t8t, transpose_pad);
    }
  });
  return {t8, inv, t8t};
}

at::Tensor fp8_transpose(const at::Tensor& t8_in, int64_t pad) {
  const char* name = "ls_fairseq fp8_transpose";
  LSF_CHECK(t8_in.is_cuda() && t8_in.dim() == 2 && t8_in.element_size() == 1, name,
            ": t8 must be a 2-D CUDA tensor of a 1-byte dtype, got ", t8_in.sizes(), " ",
            t8_in.scalar_type());
  LSF_CHECK(pad >= 1, name, ": pad must be >= 1, got ", pad);
  c10::cuda::CUDAGuard guard(t8_in.device());
  const at::Tensor t8 = t8_in.contiguous();
  const int64_t rows = t8.size(0), cols = t8.size(1);
  at::Tensor out = at::empty({cols, padded(rows, pad)}, t8.options());
  if (out.numel() == 0) return out;
  const TileShape s = tile_shape(rows, cols, out.size(1));
  const uint8_t* in = reinterpret_cast<const uint8_t*>(t8.data_ptr());
  const bool vec_in = cols % 4 == 0 && aligned(in, 4);
  const bool vec_out = s.padded_rows % 16 == 0;
  const unsigned grid = capped_grid(s.tiles, 1, kBlocksPerSm * sm_count(t8.get_device()));
  tile_kernel<uint8_t, false, Fp8::kE4M3><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      in, nullptr, reinterpret_cast<uint8_t*>(out.data_ptr()), s, vec_in, vec_out, nullptr, 0,
      nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ls_fairseq, m) {
  m.def("fp8_quantize(Tensor t, ScalarType dtype, int transpose_pad) -> (Tensor, Tensor, Tensor)");
  m.def("fp8_transpose(Tensor t8, int pad) -> Tensor");
}

TORCH_LIBRARY_IMPL(ls_fairseq, CUDA, m) {
  m.impl("fp8_quantize", &fp8_quantize);
  m.impl("fp8_transpose", &fp8_transpose);
}
