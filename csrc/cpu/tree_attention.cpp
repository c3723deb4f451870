// Tree attention on CPU: one (row, query head) per task. Scores of the T queries against
// the keys they may see (s < prefix_lens[b] + T) come from one GEMM; the packed mask bits
// are applied in place (no dense mask is built); softmax; one GEMM with the values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace spec_ext {

at::Tensor tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                              const at::Tensor& prefix_lens_in, const std::optional<at::Tensor>& tree_mask_in,
                              double scale) {
  auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  auto prefix_lens = prefix_lens_in.to(at::kLong).contiguous();
  at::Tensor tree_mask;
  if (tree_mask_in) tree_mask = tree_mask_in->contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), group = Hq / Hkv;
  const bool causal = !tree_mask.defined();
  const int64_t W = causal ? 0 : tree_mask.size(2), mask_rows = causal ? 0 : tree_mask.size(0);
  const uint32_t* bits = causal ? nullptr : reinterpret_cast<const uint32_t*>(tree_mask.data_ptr<int32_t>());
  const int64_t* L = prefix_lens.data_ptr<int64_t>();
  auto out = at::empty_like(q);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    // worker threads do not inherit inference mode; the output may be an inference tensor
    const c10::InferenceMode guard(inference);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hq, h = task % Hq;
      const int64_t prefix = L[b], limit = std::min(S, prefix + T);
      if (limit <= 0) {
        out[b][h].zero_();
        continue;
      }
      auto keys = k[b][h / group].narrow(0, 0, limit).to(at::kFloat);
      auto values = v[b][h / group].narrow(0, 0, limit).to(at::kFloat);
      auto scores = at::mm(q[b][h].to(at::kFloat), keys.t()).mul_(scale);  // [T, limit]
      float* sc = scores.data_ptr<float>();
      for (int64_t i = 0; i < T; ++i) {
        float* row = sc + i * limit;
        const uint32_t* mrow = causal ? nullptr : bits + ((mask_rows == 1 ? 0 : b) * T + i) * W;
        for (int64_t s = std::max<int64_t>(prefix, 0); s < limit; ++s) {
          const int64_t j = s - prefix;
          const bool visible = causal ? j <= i : ((mrow[j / 32] >> (j % 32)) & 1u);
          if (!visible) row[s] = kNegInf;
        }
        float best = kNegInf;
        for (int64_t s = 0; s < limit; ++s) best = std::max(best, row[s]);
        float total = 0;
        for (int64_t s = 0; s < limit; ++s) {
          row[s] = best == kNegInf ? 0.f : std::exp(row[s] - best);
          total += row[s];
        }
        const float inv = total > 0 ? 1.f / total : 0.f;
        for (int64_t s = 0; s < limit; ++s) row[s] *= inv;
      }
      out[b][h].copy_(at::mm(scores, values));
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace spec_ext
