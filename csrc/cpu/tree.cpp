#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace spec_ext {

std::tuple<at::Tensor, at::Tensor> tree_mask_cpu(const at::Tensor& parents_in) {
  auto parents = parents_in.contiguous();
  const int64_t B = parents.size(0), T = parents.size(1), W = (T + 31) / 32;
  auto depth = at::zeros({B, T}, parents.options());
  auto mask = at::zeros({B, T, W}, parents.options().dtype(at::kInt));
  const int64_t* par = parents.data_ptr<int64_t>();
  int64_t* dep = depth.data_ptr<int64_t>();
  uint32_t* bits = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < T; ++i) {
        const int64_t p = par[b * T + i];
        uint32_t* row = bits + (b * T + i) * W;
        if (p >= 0) {
          dep[b * T + i] = dep[b * T + p] + 1;
          for (int64_t w = 0; w < W; ++w) row[w] = bits[(b * T + p) * W + w];
        }
        row[i / 32] |= 1u << (i % 32);
      }
    }
  });
  return {depth, mask};
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) { m.impl("tree_mask", &tree_mask_cpu); }

}  // namespace spec_ext
