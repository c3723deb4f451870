// Tree attention on CPU: one (row, query head, query) per task; the packed mask bits are
// read directly, keys past prefix_lens[b] + T are never touched.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace spec_ext {

namespace {
template <typename scalar_t>
void tree_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& prefix_lens, const at::Tensor& tree_mask,
                           double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), group = Hq / Hkv;
  const bool causal = !tree_mask.defined();
  const int64_t W = causal ? 0 : tree_mask.size(2);
  const int64_t mask_rows = causal ? 0 : tree_mask.size(0);
  const scalar_t* Qp = q.data_ptr<scalar_t>();
  const scalar_t* Kp = k.data_ptr<scalar_t>();
  const scalar_t* Vp = v.data_ptr<scalar_t>();
  const int32_t* L = prefix_lens.data_ptr<int32_t>();
  const uint32_t* M = causal ? nullptr : reinterpret_cast<const uint32_t*>(tree_mask.data_ptr<int32_t>());
  scalar_t* O = out.data_ptr<scalar_t>();

  at::parallel_for(0, B * Hq * T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S), query(D), acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task % T, h = (task / T) % Hq, b = task / (T * Hq);
      const int64_t prefix = L[b];
      const scalar_t* qrow = Qp + ((b * Hq + h) * T + i) * D;
      for (int64_t d = 0; d < D; ++d) query[d] = static_cast<float>(qrow[d]) * static_cast<float>(scale);
      const scalar_t* kbase = Kp + (b * Hkv + h / group) * S * D;
      const scalar_t* vbase = Vp + (b * Hkv + h / group) * S * D;
      const uint32_t* bits = causal ? nullptr : M + ((mask_rows == 1 ? 0 : b) * T + i) * W;
      const int64_t limit = std::min<int64_t>(S, prefix + T);
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < limit; ++s) {
        const int64_t j = s - prefix;
        const bool visible = j < 0 || (causal ? j <= i : ((bits[j / 32] >> (j % 32)) & 1u));
        if (!visible) { scores[s] = -std::numeric_limits<float>::infinity(); continue; }
        float dot = 0;
        const scalar_t* krow = kbase + s * D;
        for (int64_t d = 0; d < D; ++d) dot += query[d] * static_cast<float>(krow[d]);
        scores[s] = dot;
        best = std::max(best, dot);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float total = 0;
      if (best > -std::numeric_limits<float>::infinity()) {
        for (int64_t s = 0; s < limit; ++s) {
          if (scores[s] == -std::numeric_limits<float>::infinity()) continue;
          const float w = std::exp(scores[s] - best);
          total += w;
          const scalar_t* vrow = vbase + s * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * static_cast<float>(vrow[d]);
        }
      }
      scalar_t* orow = O + ((b * Hq + h) * T + i) * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(total > 0 ? acc[d] / total : 0.f);
    }
  });
}
}  // namespace

at::Tensor tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                              const at::Tensor& prefix_lens_in, const std::optional<at::Tensor>& tree_mask_in,
                              double scale) {
  auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  auto prefix_lens = prefix_lens_in.to(at::kInt).contiguous();
  at::Tensor tree_mask;
  if (tree_mask_in) tree_mask = tree_mask_in->contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tree_attention_cpu", [&] {
    tree_attention_kernel<scalar_t>(q, k, v, prefix_lens, tree_mask, scale, out);
  });
  return out;
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace spec_ext
