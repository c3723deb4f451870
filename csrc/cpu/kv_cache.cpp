// compact_kv on CPU: every (tensor, row, head) slab is gathered into a buffer, then
// stored, so overlapping source and destination ranges are safe.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace spec_ext {

void compact_kv_cpu(at::TensorList caches, const at::Tensor& src_in, const at::Tensor& dst_in) {
  if (caches.empty()) return;
  auto src = src_in.contiguous();
  auto dst = dst_in.contiguous();
  const int64_t B = src.size(0), M = src.size(1);
  const int64_t H = caches[0].size(1), S = caches[0].size(2), D = caches[0].size(3);
  const int64_t row_bytes = D * caches[0].element_size();
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  std::vector<int64_t> count(B, 0);
  for (int64_t b = 0; b < B; ++b)
    while (count[b] < M && sp[b * M + count[b]] >= 0) ++count[b];

  const int64_t tasks = static_cast<int64_t>(caches.size()) * B * H;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> buffer(M * row_bytes);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, b = (task / H) % B, n = task / (H * B);
      char* base = static_cast<char*>(caches[n].data_ptr()) + (b * H + h) * S * row_bytes;
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
