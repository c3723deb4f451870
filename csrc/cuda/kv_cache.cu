// compact_kv on CUDA: one block per (tensor, row, head) slab of the stacked [N,B,H,S,D]
// caches (one base pointer and the spacing of the N tensors: nothing to build on the host);
// the moved rows are staged in shared memory (column chunk by column chunk, since columns
// never interact) before any store, so overlapping moves are safe. One launch per call.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.cuh"

namespace spec_ext {
namespace {

constexpr int64_t kStageBytes = 32 * 1024;

template <typename unit_t>
__global__ void compact_kv_kernel(unit_t* data, int64_t tensor_units, const int64_t* __restrict__ src,
                                  const int64_t* __restrict__ dst_start, int64_t B, int64_t H, int64_t S,
                                  int64_t M, int64_t units) {
  extern __shared__ char stage_raw[];
  unit_t* stage = reinterpret_cast<unit_t*>(stage_raw);
  const int64_t slab = blockIdx.x;
  const int64_t h = slab % H, b = (slab / H) % B, n = slab / (H * B);
  unit_t* base = data + n * tensor_units + (b * H + h) * S * units;
  int64_t count = 0;
  while (count < M && src[b * M + count] >= 0) ++count;
  if (count == 0) return;
  const int64_t start = dst_start[b];
  const int64_t fit = kStageBytes / (count * static_cast<int64_t>(sizeof(unit_t)));
  const int64_t width = fit < 1 ? 1 : (fit < units ? fit : units);
  for (int64_t c0 = 0; c0 < units; c0 += width) {
    const int64_t w = width < units - c0 ? width : units - c0;
    for (int64_t e = threadIdx.x; e < count * w; e += blockDim.x) {
      const int64_t j = e / w, c = c0 + e % w;
      stage[e] = base[src[b * M + j] * units + c];
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < count * w; e += blockDim.x) {
      const int64_t j = e / w, c = c0 + e % w;
      if (src[b * M + j] != start + j) base[(start + j) * units + c] = stage[e];
    }
    __syncthreads();
  }
}

template <typename unit_t>
void launch(const at::Tensor& caches, const at::Tensor& src, const at::Tensor& dst) {
  const int64_t B = src.size(0), M = src.size(1);
  const int64_t N = caches.size(0), H = caches.size(2), S = caches.size(3);
  const int64_t units = caches.size(4) * caches.element_size() / sizeof(unit_t);
  const int64_t tensor_units = caches.stride(0) * caches.element_size() / sizeof(unit_t);
  compact_kv_kernel<unit_t><<<N * B * H, kThreads, kStageBytes, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<unit_t*>(caches.data_ptr()), tensor_units, src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), B,
      H, S, M, units);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void compact_kv_cuda(const at::Tensor& caches, const at::Tensor& src_in, const at::Tensor& dst_in) {
  if (caches.numel() == 0 || src_in.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(caches.device());
  auto src = src_in.contiguous();
  auto dst = dst_in.contiguous();
  // the unit must divide a row and the spacing of the N tensors, and align the base
  const int64_t row_bytes = caches.size(4) * caches.element_size();
  const int64_t spacing = caches.stride(0) * caches.element_size();
  const auto address = reinterpret_cast<uintptr_t>(caches.data_ptr());
  if (row_bytes % 16 == 0 && spacing % 16 == 0 && address % 16 == 0) {
    launch<int4>(caches, src, dst);
  } else if (row_bytes % 4 == 0 && spacing % 4 == 0 && address % 4 == 0) {
    launch<int32_t>(caches, src, dst);
  } else {
    launch<int16_t>(caches, src, dst);
  }
}

TORCH_LIBRARY_IMPL(spec_ext, CUDA, m) { m.impl("compact_kv", &compact_kv_cuda); }

}  // namespace spec_ext
