// y = x @ weight.T (+ bias) for a few rows of x (a decode step or a verification block),
// float32. MKL's GEMM reads cold weights at 4-7 GB/s on this kind of machine for M <= 16
// (it packs them first); here every weight row is streamed once, straight from memory, and
// dotted with all M rows of x (which stay in L1): 22-26 GB/s for M <= 5, 14 GB/s at M = 8.
// Each y[m, n] is one fixed-order dot product, so a row's result does not depend on how
// many other rows come with it (M = 1 and M = 5 give the same bits for the same row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace spec_ext {
namespace {

constexpr int64_t kRowBlock = 8;  // rows of x whose accumulators live in registers at once

// Reference order of the sums below: 16 interleaved partial sums over k (lane j takes
// k = j mod 16), summed as a tree, then the tail k >= K - K % 16 added in order.
float finish_dot(const float* lanes, const float* w, const float* x, int64_t k, int64_t K) {
  float s = 0.f;
  float pairs[16];
  std::copy(lanes, lanes + 16, pairs);
  for (int64_t width = 8; width >= 1; width /= 2)
    for (int64_t j = 0; j < width; ++j) pairs[j] = pairs[j] + pairs[j + width];
  s = pairs[0];
  for (; k < K; ++k) s += w[k] * x[k];
  return s;
}

void rows_portable(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float lanes[16] = {0.f};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int64_t j = 0; j < 16; ++j) lanes[j] = std::fma(wr[k + j], xr[k + j], lanes[j]);
      y[m * N + n] = finish_dot(lanes, wr, xr, k, K);
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f,fma"))) void rows_avx512(const float* x, const float* w, float* y, int64_t M,
                                                         int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, M - m0);
      __m512 acc[kRowBlock];
      for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m512 wv = _mm512_loadu_ps(wr + k);
        for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (m0 + i) * K + k), acc[i]);
      }
      for (int64_t i = 0; i < rows; ++i) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc[i]);
        y[(m0 + i) * N + n] = finish_dot(lanes, wr, x + (m0 + i) * K, k, K);
      }
    }
  }
}
#endif

bool has_avx512() {
#if defined(__x86_64__)
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return supported;
#else
  return false;
#endif
}

}  // namespace

at::Tensor skinny_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat,
              "skinny_linear: float32 only");
  auto weight = weight_in.contiguous();
  const int64_t K = weight.size(1), N = weight.size(0);
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool vector = has_avx512();
  // a chunk of weight rows per task: at least 64 KB of weights, so a thread's wake-up pays
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#if defined(__x86_64__)
    if (vector) return rows_avx512(xp, wp, yp, M, N, K, n0, n1);
#endif
    rows_portable(xp, wp, yp, M, N, K, n0, n1);
  });
  if (bias) y.add_(*bias);
  return y.view(sizes);
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

}  // namespace spec_ext
