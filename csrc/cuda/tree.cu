#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.cuh"

namespace spec_ext {

__global__ void tree_mask_kernel(const int64_t* parents, int64_t* depth, uint32_t* mask, int64_t B, int64_t T,
                                 int64_t W) {
  const int64_t b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  for (int64_t i = 0; i < T; ++i) {
    const int64_t p = parents[b * T + i];
    uint32_t* row = mask + (b * T + i) * W;
    for (int64_t w = 0; w < W; ++w) row[w] = p >= 0 ? mask[(b * T + p) * W + w] : 0u;
    depth[b * T + i] = p >= 0 ? depth[b * T + p] + 1 : 0;
    row[i / 32] |= 1u << (i % 32);
  }
}

std::tuple<at::Tensor, at::Tensor> tree_mask_cuda(const at::Tensor& parents_in) {
  const c10::cuda::CUDAGuard guard(parents_in.device());
  auto parents = parents_in.contiguous();
  const int64_t B = parents.size(0), T = parents.size(1), W = (T + 31) / 32;
  auto depth = at::empty({B, T}, parents.options());
  auto mask = at::empty({B, T, W}, parents.options().dtype(at::kInt));
  if (B > 0 && T > 0) {
    tree_mask_kernel<<<(B + 127) / 128, 128, 0, at::cuda::getCurrentCUDAStream()>>>(
        parents.data_ptr<int64_t>(), depth.data_ptr<int64_t>(),
        reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>()), B, T, W);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {depth, mask};
}

TORCH_LIBRARY_IMPL(spec_ext, CUDA, m) { m.impl("tree_mask", &tree_mask_cuda); }

}  // namespace spec_ext
