// Tree attention on CPU, two ways. One new token per row (the draft's decode steps): one
// (row, key/value head) per task, the scores from skinny_linear's fixed-order kernel and
// plain loops over raw pointers with float accumulation (attend), the K/V rows a GQA group
// shares read once for all its query heads; that is less work than launching ATen ops per
// head (2.5x faster at H=32, S=4096, D=128 and at H=10, S=250, D=32, measured before the
// scores came from skinny_linear). From two new tokens on (verification, trees, prefill), GEMMs:
// while all scores fit in 4 MB, two batched GEMMs over [B, kv heads] up to the longest row
// (a GQA group's query heads are extra query rows; shorter rows' extra keys are masked),
// two ATen calls per layer instead of two per (row, head), which made batch 8 slower than
// HF's fused SDPA; beyond that, one (row, query head) at a time, whose [T, keys] scores
// stay in cache (1.8x faster than batched at B=8, H=32, T=64, S=4096).
// The GEMM paths expand the packed mask bits once into a [B, T, keys] bool mask that every
// head shares, and take ATen's vectorised softmax (1.2-1.5x faster than a scalar loop with
// std::exp, side by side at B=1..8, T=5..64).
// A sliding window also goes into that mask. Each row's keys are its span, [first,
// prefix + T): first is 0 without a window, else its shallowest query's position - window +
// 1 (the root sits at prefix: prefix - window + 1). Keys outside a row's span never reach its
// output, so they may hold anything (NaN included): the loop and per-head paths never read
// them; the batched GEMMs of a ragged batch read the union of the rows' spans, mask the
// scores, and multiply a row whose output came out NaN (0 * NaN) again over its own span.
// A sink is one more term of the softmax's denominator, exp(sink), with no value; a query
// that sees no key gets zeros, whatever its sink (-inf included: exp(-inf) = 0 is no sink).
// Values may be narrower or wider than keys (Dv != D: MLA); the output has the values' width.
// Width invariance: the GEMM paths' sums follow ATen's GEMM, whose order depends on the number
// of queries, so a query's bits depend on T; tree_attention_invariant takes the loop path at
// every T, in one fixed order per query (see attend), and its queries do not (the loop path
// costs more than the GEMMs from a few queries on: docs/invariance.md).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "skinny_linear.h"

namespace spec_ext {
namespace {

constexpr int64_t kLoopQueries = 1;
constexpr int64_t kBatchedScores = int64_t{1} << 20;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The tree's mask and positions: node j of row b sits at prefix_lens[b] + depth(b, j), its
// depth being the popcount of its mask row minus one (the causal chain, no mask: j). Only a
// window reads positions, so without one no depth is counted.
struct Tree {
  const uint32_t* bits;  // [mask_rows, T, W] packed, or nullptr: causal
  int64_t mask_rows, T, W;
  std::vector<int64_t> depths;  // [mask_rows or 1, T]; empty without a window

  Tree(const uint32_t* bits_, int64_t mask_rows_, int64_t T_, int64_t W_, bool windowed)
      : bits(bits_), mask_rows(bits_ ? mask_rows_ : 1), T(T_), W(W_), depths(windowed ? mask_rows * T : 0) {
    if (!windowed) return;
    for (int64_t r = 0; r < mask_rows; ++r) {
      for (int64_t j = 0; j < T; ++j) {
        int64_t count = 0;
        if (bits) {
          for (int64_t w = 0; w < W; ++w) count += __builtin_popcount(bits[(r * T + j) * W + w]);
        }
        depths[r * T + j] = bits ? count - 1 : j;
      }
    }
  }
  const uint32_t* row(int64_t b, int64_t i) const { return bits ? bits + ((mask_rows == 1 ? 0 : b) * T + i) * W : nullptr; }
  int64_t depth(int64_t b, int64_t j) const { return depths[(mask_rows == 1 ? 0 : b) * T + j]; }
  // The first key any query of row b (with this prefix) sees: 0 without a window, else the
  // shallowest query's position - window + 1 (a mask row without its own bit has depth -1).
  int64_t first_key(int64_t b, int64_t prefix, int64_t window) const {
    if (!window || T == 0) return 0;
    int64_t shallowest = depth(b, 0);
    for (int64_t i = 1; i < T; ++i) shallowest = std::min(shallowest, depth(b, i));
    return std::max<int64_t>(prefix + shallowest - window + 1, 0);
  }
  // whether query i of row b (its mask row mrow) sees key s: the prefix, or an ancestor in
  // the tree, and within the window (0: none)
  bool sees(const uint32_t* mrow, int64_t b, int64_t prefix, int64_t i, int64_t s, int64_t window) const {
    const int64_t j = s - prefix;
    if (j >= 0 && !(mrow ? ((mrow[j / 32] >> (j % 32)) & 1u) : j <= i)) return false;
    return window == 0 || depth(b, i) - (j >= 0 ? depth(b, j) : j) < window;
  }
};


// The keys each row reads, [lo[b], hi[b]), their union [first, last), and whether some
// row's span is not the union (a ragged batch, or rows whose windows start apart).
struct Spans {
  std::vector<int64_t> lo, hi;
  int64_t first, last;
  bool ragged;
};

// Which keys first + c each (row, query) may not see, [B, 1, 1, T, columns] (the same for
// every head), and whether some query sees no key at all (its softmax would be NaN; it gets zeros).
std::pair<at::Tensor, bool> hidden_keys(const at::Tensor& q, const int64_t* prefix_lens, const Tree& tree,
                                        int64_t window, int64_t S, int64_t first, int64_t columns) {
  const int64_t B = q.size(0), T = q.size(2);
  auto hidden = at::empty({B, 1, 1, T, columns}, q.options().dtype(at::kBool));
  bool* hide = hidden.data_ptr<bool>();
  bool blind = false;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t prefix = std::max<int64_t>(prefix_lens[b], 0), limit = std::min(S, prefix + T);
    for (int64_t i = 0; i < T; ++i) {
      const uint32_t* mrow = tree.row(b, i);
      bool* row = hide + (b * T + i) * columns;
      bool none = true;
      for (int64_t c = 0; c < columns; ++c) {
        const int64_t s = first + c;
        row[c] = s >= limit || !tree.sees(mrow, b, prefix, i, s, window);
        none = none && row[c];
      }
      blind = blind || none;
    }
  }
  return {hidden, blind};
}

// scores [..., keys] -> softmax weights, in place, with the sink logits [...] (broadcast to
// scores' leading dimensions) as one more term of the denominator when given; masked scores
// are -inf. The sink enters the max, so no exp overflows and a row with no key gets zeros.
at::Tensor softmax_with_sinks(at::Tensor scores, const std::optional<at::Tensor>& sink) {
  if (!sink) return at::softmax(scores, -1);
  const auto best = at::maximum(std::get<0>(scores.max(-1, true)), *sink);
  scores.sub_(best).exp_();
  return scores.div_(scores.sum(-1, true).add_((*sink - best).exp_()));
}

inline float soft_capped(float score, float softcap) {
  return softcap > 0.f ? softcap * std::tanh(score / softcap) : score;
}

// exp(x) for a softmax's x = score - max <= 0, in float32 operations only (Cephes' expf:
// x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial in r, times 2^n), so a vectorised loop
// and its scalar remainder give every element the same bits: which lane or position an element
// takes never changes its value (unlike libm's scalar exp beside a vector one). No fused
// multiply-adds: the baseline x86-64 target this file is built for has none to contract into.
// Relative error about 2e-7; below -87 (exp < 2^-125) it gives 0, at -inf 0, at NaN NaN.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  const float n = (clamped * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

// One query's softmax and weighted values over its scores [0, span) (unseen keys' -inf):
// w = exp_nonpositive(score - best) for every key (a loop the compiler vectorises), then key
// by key in rising order total += w, acc[d] += w * value[d] over the seen ones; total starts
// at the sink's exp(sink - best). Returns total. Compiled twice, for the baseline target and
// for AVX2 (wider vectors): neither has fused multiply-adds to contract into, and a product
// and a sum are the same correctly rounded operations in any vector width, so the two give
// the same bits.
template <int kPath>
__attribute__((always_inline)) inline float softmax_row(const float* score, float* weights, const float* values, float* acc, int64_t span,
                         int64_t Dv, float best, float sink) {
  for (int64_t c = 0; c < span; ++c) weights[c] = exp_nonpositive(score[c] - best);
  float total = exp_nonpositive(sink - best);  // exp(-inf) = 0: no sink
  for (int64_t c = 0; c < span; ++c) {
    if (score[c] == kNegInf) continue;  // unseen (or a score of -inf: weight 0); its value may be NaN
    const float w = weights[c];
    total += w;
    const float* value = values + c * Dv;
    for (int64_t d = 0; d < Dv; ++d) acc[d] += w * value[d];
  }
  return total;
}
// no-trapping-math: GCC keeps a comparison's select (exp_nonpositive's clamp) a branch, and so
// the exp loop scalar, while FP exceptions may trap; values are the same either way
#define SPEC_EXT_SELECTS __attribute__((optimize("no-trapping-math")))
#if defined(__x86_64__)
__attribute__((target("avx2"))) SPEC_EXT_SELECTS float softmax_row_avx2(const float* score, float* weights,
                                                                        const float* values, float* acc, int64_t span,
                                                                        int64_t Dv, float best, float sink) {
  return softmax_row<1>(score, weights, values, acc, span, Dv, best, sink);
}
#endif
SPEC_EXT_SELECTS float softmax_row_portable(const float* score, float* weights, const float* values, float* acc,
                                            int64_t span, int64_t Dv, float best, float sink) {
  return softmax_row<0>(score, weights, values, acc, span, Dv, best, sink);
}

// n elements to float32 (exact for every type); float16 by F16C where the vector path is on
// (c10::Half's own conversion is bit arithmetic, one element at a time)
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void widen_f16c(const c10::Half* source, float* out, int64_t n) {
  int64_t e = 0;
  for (; e + 8 <= n; e += 8)
    _mm256_storeu_ps(out + e, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source + e))));
  for (; e < n; ++e) out[e] = static_cast<float>(source[e]);
}
#endif
template <typename scalar_t>
void widen(const scalar_t* source, float* out, int64_t n, bool wide) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    if (wide) return widen_f16c(source, out, n);
  }
#endif
  for (int64_t e = 0; e < n; ++e) out[e] = static_cast<float>(source[e]);
}

// One query at a time, each over the keys it sees in rising order (the loop path: T = 1, and
// every T for tree_attention_invariant). A query's output is a function of its own q, the keys
// and values it sees (in order), the scale, softcap and its head's sink only: never of T, of
// the other queries, of where the call's keys start or end, or of the thread that runs it.
// So query i of a block of T equals the same query alone (T = 1, prefix + i, the block's
// earlier tokens in the cache), and a tree node equals the same node over its path compacted
// (its keys in the same order). The order: each score q * scale . key by skinny_linear's
// kernel (fixed_order_products: one fixed order per (query, key), the same on every ISA
// path), then soft-capped; the max over the seen keys and the sink (exact in any order); then
// softmax_row. One task per (row, kv head): its group's query heads and queries take their
// scores from one call over the keys any of them may see, and the K/V rows are read (and for
// 16-bit types widened) once for all of them.
template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out, const int64_t* prefix_lens,
            const Tree& tree, int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t S, int64_t D, int64_t Dv,
            int64_t longest, float scale, int64_t window, float softcap, const float* sinks) {
  const int64_t group = Hq / Hkv, R = group * T;
  const at::ScalarType key_type = c10::CppTypeToScalarType<scalar_t>::value;
  // AVX2 (and F16C) where skinny_linear takes a vector path (SPEC_EXT_CPU_ISA=portable: not)
  const bool wide = std::strcmp(skinny_linear_isa(), "portable") != 0;
#if defined(__x86_64__)
  auto* const row_softmax = wide ? &softmax_row_avx2 : &softmax_row_portable;
#else
  auto* const row_softmax = &softmax_row_portable;
#endif
  // enough multiply-adds per chunk that a thread's wake-up is worth it
  const int64_t work = std::max<int64_t>(1, R * longest * D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / work);
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(R * D), scores, weights, widened, acc(Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      const int64_t prefix = std::max<int64_t>(prefix_lens[b], 0), limit = std::min(S, prefix + T);
      // the keys any of these queries may see: from the shallowest one's window on
      const int64_t first = std::min(tree.first_key(b, prefix, window), limit), span = limit - first;
      for (int64_t r = 0; r < R; ++r) {  // r = (h - g * group) * T + i
        const scalar_t* row = q + ((b * Hq + g * group) * T + r) * D;
        for (int64_t d = 0; d < D; ++d) queries[r * D + d] = static_cast<float>(row[d]) * scale;
      }
      scores.resize(R * span);
      fixed_order_products(queries.data(), D, k + (task * S + first) * D, key_type, D, scores.data(), R, span, D);
      const float* values = nullptr;
      if constexpr (std::is_same_v<scalar_t, float>) {
        values = v + (task * S + first) * Dv;
      } else {
        widened.resize(span * Dv);
        const scalar_t* source = v + (task * S + first) * Dv;
        widen(source, widened.data(), span * Dv, wide);
        values = widened.data();
      }
      weights.resize(span);
      const int64_t in_prefix = std::min(prefix, limit) - first;  // keys [first, prefix): the cache's
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = g * group + r / T, i = r % T;
        scalar_t* o = out + ((b * Hq + h) * T + i) * Dv;
        const uint32_t* mrow = tree.row(b, i);
        float* score = scores.data() + r * span;
        const float sink = sinks ? sinks[h] : kNegInf;
        float best = sink;
        // a cached key is seen from this query's window on (prefix + depth - window + 1; all without one)
        const int64_t seen_from = window ? std::max<int64_t>(prefix + tree.depth(b, i) - window + 1, 0) - first : 0;
        for (int64_t c = 0; c < in_prefix; ++c) {
          if (c < seen_from) {
            score[c] = kNegInf;
            continue;
          }
          score[c] = soft_capped(score[c], softcap);
          best = std::max(best, score[c]);
        }
        for (int64_t c = std::max<int64_t>(in_prefix, 0); c < span; ++c) {  // the new tokens: the tree decides
          if (!tree.sees(mrow, b, prefix, i, first + c, window)) {
            score[c] = kNegInf;
            continue;
          }
          score[c] = soft_capped(score[c], softcap);
          best = std::max(best, score[c]);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        const float total = best != kNegInf ? row_softmax(score, weights.data(), values, acc.data(), span, Dv, best, sink)
                                            : 0.f;
        const float inv = total > 0.f ? 1.f / total : 0.f;  // a query that sees no key: zeros
        for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<scalar_t>(acc[d] * inv);
      }
    }
  });
}

void attend_per_head(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                     const at::Tensor& hidden, bool blind, const Spans& spans, double scale, double softcap,
                     const std::optional<at::Tensor>& sinks) {
  const int64_t B = q.size(0), Hq = q.size(1), group = Hq / k.size(1);
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, B * Hq, 1, [&](int64_t begin, int64_t end) {
    const c10::InferenceMode guard(inference);  // worker threads do not inherit it; out may be an inference tensor
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hq, h = task % Hq;
      const int64_t start = spans.lo[b], limit = spans.hi[b];
      if (limit <= start) {
        out[b][h].zero_();
        continue;
      }
      auto keys = k[b][h / group].narrow(0, start, limit - start).to(at::kFloat);
      auto values = v[b][h / group].narrow(0, start, limit - start).to(at::kFloat);
      auto hide = hidden[b][0][0].narrow(1, start - spans.first, limit - start);  // [T, keys]
      auto scores = at::mm(q[b][h].to(at::kFloat), keys.t()).mul_(scale);
      if (softcap > 0) scores.div_(softcap).tanh_().mul_(softcap);
      scores.masked_fill_(hide, kNegInf);
      auto weights = softmax_with_sinks(scores, sinks ? std::optional<at::Tensor>((*sinks)[h]) : std::nullopt);
      if (blind) weights.masked_fill_(hide.all(-1, true), 0.f);
      out[b][h].copy_(at::mm(weights, values));
    }
  });
}

template <typename scalar_t>
bool has_nan(const scalar_t* data, int64_t n) {
  bool any = false;
#pragma omp simd reduction(|| : any)
  for (int64_t i = 0; i < n; ++i) any = any || std::isnan(static_cast<float>(data[i]));
  return any;
}

// Which rows b of the contiguous out [B, ...] hold a NaN (a scan, no ATen call: a few us).
std::vector<char> rows_with_nan(const at::Tensor& out) {
  const int64_t B = out.size(0), per_row = B ? out.numel() / B : 0;
  std::vector<char> nan(B, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "rows_with_nan", [&] {
    for (int64_t b = 0; b < B; ++b) nan[b] = has_nan(out.data_ptr<scalar_t>() + b * per_row, per_row);
  });
  return nan;
}

void attend_batched(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                    const at::Tensor& hidden, bool blind, const Spans& spans, double scale, double softcap,
                    const std::optional<at::Tensor>& sinks) {
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), group = Hq / Hkv, first = spans.first, columns = spans.last - spans.first;
  const int64_t Dv = v.size(3);
  // a GQA group's query heads become extra query rows of its kv head: [B, Hkv, group*T, D]
  auto queries = q.to(at::kFloat).view({B, Hkv, group * T, D});
  auto keys = k.narrow(2, first, columns).to(at::kFloat);
  auto values = v.narrow(2, first, columns).to(at::kFloat);
  auto scores = at::matmul(queries, keys.transpose(2, 3)).mul_(scale).view({B, Hkv, group, T, columns});
  if (softcap > 0) scores.div_(softcap).tanh_().mul_(softcap);
  scores.masked_fill_(hidden, kNegInf);  // also where another row's key outside this row's span gave NaN
  auto weights = softmax_with_sinks(scores, sinks ? std::optional<at::Tensor>(sinks->view({Hkv, group, 1, 1}))
                                                  : std::nullopt);
  if (blind) weights.masked_fill_(hidden.all(-1, true), 0.f);
  weights = weights.view({B, Hkv, group * T, columns});
  out.copy_(at::matmul(weights, values).view({B, Hq, T, Dv}));
  if (!spans.ragged) return;
  // Rows whose spans differ: each row's values outside its own span were multiplied by weight
  // 0, and 0 * NaN is NaN. A row that came out with NaN is multiplied again over its own
  // span alone (a scan of the output instead of two GEMMs per row on every call, which took
  // 1.6-2.4x the batched time at B=8, Hq=6-10, D=32, T=4-6).
  const std::vector<char> redo = rows_with_nan(out);
  auto rows = out.view({B, Hkv, group * T, Dv});
  for (int64_t b = 0; b < B; ++b) {
    if (!redo[b] || (spans.lo[b] == first && spans.hi[b] == spans.last)) continue;
    const int64_t n = spans.hi[b] - spans.lo[b];
    if (n <= 0) {
      rows[b].zero_();
      continue;
    }
    rows[b].copy_(at::bmm(weights[b].narrow(2, spans.lo[b] - first, n),
                          v[b].narrow(1, spans.lo[b], n).to(at::kFloat)));
  }
}

}  // namespace

namespace {
at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                     const at::Tensor& prefix_lens_in, const std::optional<at::Tensor>& tree_mask_in, double scale,
                     int64_t window, double softcap, const std::optional<at::Tensor>& sinks_in, bool invariant) {
  TORCH_CHECK(window >= 0, "tree_attention (cpu): window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "tree_attention (cpu): softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(!sinks_in || sinks_in->numel() == q_in.size(1), "tree_attention (cpu): sinks must hold one logit per query head (",
              q_in.size(1), "), got ", sinks_in ? sinks_in->numel() : 0);
  auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  std::optional<at::Tensor> sinks;
  if (sinks_in) sinks = sinks_in->to(at::kFloat).contiguous();
  auto prefix_lens = prefix_lens_in.to(at::kLong).contiguous();
  at::Tensor tree_mask;
  if (tree_mask_in) tree_mask = tree_mask_in->contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  const uint32_t* bits =
      tree_mask.defined() ? reinterpret_cast<const uint32_t*>(tree_mask.data_ptr<int32_t>()) : nullptr;
  const int64_t W = bits ? tree_mask.size(2) : 0, mask_rows = bits ? tree_mask.size(0) : 0;
  const int64_t* lengths = prefix_lens.data_ptr<int64_t>();
  TORCH_CHECK(v.size(0) == B && v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "tree_attention (cpu): v must be [B, Hkv, S, Dv] like k's [B, Hkv, S], got ", v.sizes());
  auto out = at::empty({B, Hq, T, v.size(3)}, q.options());
  if (q.numel() == 0) return out;
  const Tree tree(bits, mask_rows, T, W, window > 0);
  Spans spans{std::vector<int64_t>(B), std::vector<int64_t>(B), S, 0, false};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t prefix = std::max<int64_t>(lengths[b], 0);
    spans.hi[b] = std::min(S, prefix + T);
    spans.lo[b] = std::min(tree.first_key(b, prefix, window), spans.hi[b]);
    spans.first = std::min(spans.first, spans.lo[b]);
    spans.last = std::max(spans.last, spans.hi[b]);
  }
  if (spans.last <= spans.first) return out.zero_();
  for (int64_t b = 0; b < B; ++b) spans.ragged = spans.ragged || spans.lo[b] != spans.first || spans.hi[b] != spans.last;
  if (T <= kLoopQueries || invariant) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tree_attention_cpu", [&] {
      attend<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), lengths, tree, B, Hq, Hkv, T, S, D, v.size(3), spans.last,
                       static_cast<float>(scale), window, static_cast<float>(softcap),
                       sinks ? sinks->data_ptr<float>() : nullptr);
    });
  } else {
    const int64_t columns = spans.last - spans.first;
    const auto [hidden, blind] = hidden_keys(q, lengths, tree, window, S, spans.first, columns);
    if (B * Hq * T * columns <= kBatchedScores) {  // launches dominate: batch them
      attend_batched(q, k, v, out, hidden, blind, spans, scale, softcap, sinks);
    } else {  // one head at a time keeps its scores in cache
      attend_per_head(q, k, v, out, hidden, blind, spans, scale, softcap, sinks);
    }
  }
  return out;
}

}  // namespace

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& prefix_lens, const std::optional<at::Tensor>& tree_mask, double scale,
                              int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  return attention(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks, false);
}

// Every T on the loop path (attend): each query's output independent of T and of the other
// queries (see attend for the order)
at::Tensor tree_attention_invariant_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& prefix_lens, const std::optional<at::Tensor>& tree_mask,
                                        double scale, int64_t window, double softcap,
                                        const std::optional<at::Tensor>& sinks) {
  return attention(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks, true);
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) {
  m.impl("tree_attention", &tree_attention_cpu);
  m.impl("tree_attention_invariant", &tree_attention_invariant_cpu);
}

}  // namespace spec_ext
