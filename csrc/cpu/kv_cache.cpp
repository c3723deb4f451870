// compact_kv on CPU: every (tensor, row, head) slab of the stacked [N,B,H,S,D] caches is
// gathered into a buffer, then stored, so overlapping source and destination ranges are safe.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace spec_ext {

void compact_kv_cpu(const at::Tensor& caches, const at::Tensor& src_in, const at::Tensor& dst_in) {
  if (caches.numel() == 0 || src_in.numel() == 0) return;
  auto src = src_in.contiguous();
  auto dst = dst_in.contiguous();
  const int64_t N = caches.size(0), B = src.size(0), M = src.size(1);
  const int64_t H = caches.size(2), S = caches.size(3), D = caches.size(4);
  const int64_t row_bytes = D * caches.element_size();
  const int64_t tensor_bytes = caches.stride(0) * caches.element_size();  // any spacing of the N tensors
  char* data = static_cast<char*>(caches.data_ptr());
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  std::vector<int64_t> count(B, 0);
  for (int64_t b = 0; b < B; ++b)
    while (count[b] < M && sp[b * M + count[b]] >= 0) ++count[b];

  at::parallel_for(0, N * B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> buffer(M * row_bytes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, b = (task / H) % B, n = task / (H * B);
      char* base = data + n * tensor_bytes + (b * H + h) * S * row_bytes;
      const int64_t m = count[b], start = dp[b];
      for (int64_t j = 0; j < m; ++j)
        std::memcpy(buffer.data() + j * row_bytes, base + sp[b * M + j] * row_bytes, row_bytes);
      for (int64_t j = 0; j < m; ++j)
        if (sp[b * M + j] != start + j)
          std::memcpy(base + (start + j) * row_bytes, buffer.data() + j * row_bytes, row_bytes);
    }
  });
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) { m.impl("compact_kv", &compact_kv_cpu); }

}  // namespace spec_ext
