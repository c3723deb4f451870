// y = x @ weight.T (+ bias) for a few rows of x (decode steps, verification blocks): float32
// accumulation; float32 x with float32, bfloat16 or float16 weights (bfloat16 -> float32 is a
// 16-bit shift, float16 -> float32 one instruction, both exact: half the bytes to read), or
// bfloat16 / float16 x with weights of its dtype
// (both widened exactly to float32, the sum and the bias in float32, y rounded once to x's
// dtype); on AVX-512, AVX2 + FMA (+ F16C) or portable C++, chosen at run time
// (SPEC_EXT_CPU_ISA forces a lower path), bit-equal on all three.
//
// The weight-read limit: each weight element is loaded from memory once for all rows of x.
// A register block holds MR rows of x times NR weight rows (NR * MR accumulators, e.g. 4 x 3
// on AVX2, 4 x 8 or 8 x 6 on AVX-512); a k step loads NR weight vectors and MR vectors of x and does
// NR * MR fused multiply-adds. With more rows than one block, the other row blocks reuse the
// weight vectors from L1: when K is long (a down projection) the weight rows go by in tiles of
// a few register blocks, and within a tile the k range is cut into chunks (the x chunk of every
// row stays in L1/L2); the tile's partial sums wait in a small buffer between chunks (its size
// does not grow with N), and every weight chunk is read from memory once. Threads split the
// weight rows (N). One register block (block_body) serves every path, over the path's own
// vector operations (PortableOps, Avx2Ops, Avx512Ops), compiled into each path's target.
//
// The order of every sum, on every path (so a row's result is the same bits whatever other
// rows come with it, whatever the chunking, threading and ISA): 8 interleaved partial sums
// over k < K8 = K - K % 8 (lane j takes k = j mod 8, one fused multiply-add per k, k rising),
// added as a tree (j + j+4, then j + j+2, then 0 + 1), then the tail k >= K8 fused in
// order, then + bias (all float32), then one rounding to x's dtype. AVX-512 keeps two weight
// rows' 8 lanes in one 16-lane register (lanes 0-7: row n, 8-15: row n+1; x broadcast into
// both halves), AVX2 one per register, the portable loop an array of 8.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "skinny_linear.h"

namespace spec_ext {
namespace {

using bf16 = c10::BFloat16;
using f16 = c10::Half;

// float32 of an element of x or of the weight; exact for all three types
inline float widen(float w) { return w; }
inline float widen(bf16 w) {
  const uint32_t u = uint32_t{w.x} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float widen(f16 w) { return c10::detail::fp16_ieee_to_fp32_value(w.x); }

// What a register block works on. x rows [m0, m0 + MR) at x + m * ldx, weight rows
// [n, n + NR) at w + n * ldw, the k range [k0, k1) (multiples of 8, k1 <= K8); partial
// sums from / to `partial` (MR x NR x 8 floats in the path's own layout) unless the block
// starts (k0 == 0) or ends (k1 == K8) the sum; at the end y[m, n] = tree + tail + bias.
template <typename X, typename W>
struct Block {
  const X* x;
  int64_t ldx;
  const W* w;
  int64_t ldw;
  X* y;
  int64_t ldy;
  const float* bias;  // [N] or null
  int64_t K, k0, k1;
  bool first, last;
  float* partial;
  // Software prefetch (see columns): null, or a stream pointer that advances prefetch_step bytes
  // per k step, prefetch_lines cache lines at each step (contiguous rows) ...
  const char* prefetch;
  int64_t prefetch_step;
  int prefetch_lines;
  // ... or null, or the first of next_rows weight rows next_ldw bytes apart, of which this block
  // prefetches the bytes [next_offset, next_offset + next_step * its k steps) of each row
  const char* next;
  int64_t next_ldw;
  int next_rows;
  int64_t next_offset, next_step;
};

// y[m0 + i, n + r] = t[i * NR + r] (the tree of its 8 lanes) + the tail + the bias: the one
// finish of every path
template <int MR, int NR, typename X, typename W>
inline void finish(const float* t, const Block<X, W>& b, int64_t m0, int64_t n) {
  const int64_t K8 = b.K - b.K % 8;
  for (int i = 0; i < MR; ++i) {
    const X* xr = b.x + (m0 + i) * b.ldx;
    X* yr = b.y + (m0 + i) * b.ldy + n;
    for (int r = 0; r < NR; ++r) {
      float s = t[i * NR + r];
      const W* wr = b.w + (n + r) * b.ldw;
      for (int64_t k = K8; k < b.K; ++k) s = std::fma(widen(wr[k]), widen(xr[k]), s);
      yr[r] = static_cast<X>(b.bias != nullptr ? s + b.bias[n + r] : s);  // the one rounding to X
    }
  }
}

// ------------------------------------------------------------------ the paths' vector operations
// Every path runs the one register block below (block_body) over its own operations: V holds
// `rows` weight rows' 8 lanes (the portable loop and AVX2 one, AVX-512 two: lanes 0-7 row n,
// 8-15 row n + 1, x broadcast into both halves). load_w(a, b) loads 8 weights of row a (and of
// row b into the upper half where V holds two); load_x 8 floats of a row of x (into every
// half); fma(w, x, acc) = w * x + acc, fused, lane by lane; load / store move the partial
// sums of a V (rows * 8 floats); trees gives each weight row's tree of its 8 lanes.
struct PortableOps {
  struct V {
    float l[8];
  };
  static constexpr int rows = 1;
  static V zero() { return V{}; }
  template <typename W>
  static V load_w(const W* a, const W*) {
    V v;
    for (int j = 0; j < 8; ++j) v.l[j] = widen(a[j]);
    return v;
  }
  template <typename X>
  static V load_x(const X* p) {
    V v;
    for (int j = 0; j < 8; ++j) v.l[j] = widen(p[j]);
    return v;
  }
  static V fma(const V& w, const V& x, V acc) {
    for (int j = 0; j < 8; ++j) acc.l[j] = std::fma(w.l[j], x.l[j], acc.l[j]);
    return acc;
  }
  static V load(const float* p) { return load_x<float>(p); }
  static void store(float* p, const V& v) {
    for (int j = 0; j < 8; ++j) p[j] = v.l[j];
  }
  template <int MR, int NP, int NR>
  static void trees(const V (&acc)[MR][NP], float* t) {
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) {
        const float* l = acc[i][r].l;
        const float u0 = l[0] + l[4], u1 = l[1] + l[5], u2 = l[2] + l[6], u3 = l[3] + l[7];
        t[i * NR + r] = (u0 + u2) + (u1 + u3);
      }
  }
};

// One register block: y[m0 .. m0 + MR, n .. n + NR] over k in [b.k0, b.k1) (see Block). A k
// step loads the NR weight rows' 8 weights once (NP vectors) and each of the MR rows of x
// once, and does MR * NP fused multiply-adds. Compiled into each path's own `block` (which
// carries the path's target and flattens this and the operations into it).
template <class Ops, int MR, int NR, typename X, typename W>
inline void block_body(const Block<X, W>& b, int64_t m0, int64_t n) {
  using V = typename Ops::V;
  constexpr int R = Ops::rows, NP = (NR + R - 1) / R;  // an odd last row pairs with itself (R = 2)
  V acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) acc[i][p] = b.first ? Ops::zero() : Ops::load(b.partial + (i * NP + p) * 8 * R);
  const X* x = b.x + m0 * b.ldx;
  const W* w = b.w + n * b.ldw;
  const char* ahead = b.prefetch;
  int64_t next_at = b.next_offset;
  for (int64_t k = b.k0; k < b.k1; k += 8) {
    // __builtin_prefetch (locality 1: _mm_prefetch's T2, into L2), here: in an operation of its
    // own, GCC finds the call free of effects and drops it
    if (ahead != nullptr) {
#pragma GCC unroll 8
      for (int q = 0; q < b.prefetch_lines; ++q) __builtin_prefetch(ahead + 64 * q, 0, 1);
      ahead += b.prefetch_step;
    }
    if (b.next != nullptr) {
      if ((next_at & 63) < b.next_step)  // the share enters a new line of each row
        for (int r = 0; r < b.next_rows; ++r) __builtin_prefetch(b.next + r * b.next_ldw + next_at, 0, 1);
      next_at += b.next_step;
    }
    V wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = Ops::load_w(w + (R * p) * b.ldw + k, w + std::min(R * p + R - 1, NR - 1) * b.ldw + k);
    for (int i = 0; i < MR; ++i) {
      const V xv = Ops::load_x(x + i * b.ldx + k);
      for (int p = 0; p < NP; ++p) acc[i][p] = Ops::fma(wv[p], xv, acc[i][p]);
    }
  }
  if (!b.last) {
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < NP; ++p) Ops::store(b.partial + (i * NP + p) * 8 * R, acc[i][p]);
    return;
  }
  float t[MR * NR];
  Ops::template trees<MR, NP, NR>(acc, t);
  finish<MR, NR, X, W>(t, b, m0, n);
}

// (MR, NR) of the main block on the portable and AVX2 paths: the rows of x in one block (up
// to 4), and 4 weight rows (3 for 4 rows of x: 12 accumulators of the 16 ymm registers).
// Measured with AVX2 on an AMD EPYC (320 -> 16384, 1-4 rows): 4 weight rows beat 2, 3, 6 and 8
// at one row of x
inline std::pair<int, int> plan_16_registers(int64_t M) {
  return M <= 3 ? std::pair{static_cast<int>(M), 4} : std::pair{4, 3};
}

#define SPEC_EXT_FLATTEN __attribute__((flatten))
struct Portable {
  static constexpr int max_rows = 4, max_cols = 4;
  static constexpr bool prefetches = false;
  static constexpr int padded(int nr) { return nr; }
  static std::pair<int, int> plan(int64_t M) { return plan_16_registers(M); }
  template <int MR, int NR, typename X, typename W>
  SPEC_EXT_FLATTEN static void block(const Block<X, W>& b, int64_t m0, int64_t n) {
    block_body<PortableOps, MR, NR, X, W>(b, m0, n);
  }
};

#if defined(__x86_64__)
// F16C: float16 -> float32 conversions (every CPU with AVX2 and FMA has it; supported_isa checks)
#define SPEC_EXT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPEC_EXT_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// the portable loop's tree (j + j+4, j + j+2, 0 + 1) of `count` registers' 8 lanes each, four
// registers at a time: t[c] = the tree of v[c]
SPEC_EXT_AVX2 inline __m128 tree4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  // lanes 0-3: a's j + j+4, 4-7: b's (ab); c's and d's (cd); then j + j+2: a, c | b, d
  const __m256 acbd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_hadd_ps(acbd, acbd);  // 0 + 1: lanes 0, 1 a and c; 4, 5 b and d
  return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));  // a, b, c, d
}
SPEC_EXT_AVX2 inline float tree_avx2(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
template <int count>
SPEC_EXT_AVX2 inline void trees_avx2(const __m256* v, float* t) {
  int c = 0;
  for (; c + 4 <= count; c += 4) _mm_storeu_ps(t + c, tree4_avx2(v[c], v[c + 1], v[c + 2], v[c + 3]));
  for (; c < count; ++c) t[c] = tree_avx2(v[c]);
}

struct Avx2Ops {
  using V = __m256;
  static constexpr int rows = 1;
  SPEC_EXT_AVX2 static inline V zero() { return _mm256_setzero_ps(); }
  SPEC_EXT_AVX2 static inline V load_w(const float* a, const float*) { return _mm256_loadu_ps(a); }
  SPEC_EXT_AVX2 static inline V load_w(const bf16* a, const bf16*) { return load_x(a); }
  SPEC_EXT_AVX2 static inline V load_w(const f16* a, const f16*) { return load_x(a); }
  SPEC_EXT_AVX2 static inline V load_x(const float* p) { return _mm256_loadu_ps(p); }
  SPEC_EXT_AVX2 static inline V load_x(const bf16* p) {  // a 16-bit shift
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  SPEC_EXT_AVX2 static inline V load_x(const f16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  SPEC_EXT_AVX2 static inline V fma(V w, V x, V acc) { return _mm256_fmadd_ps(w, x, acc); }
  SPEC_EXT_AVX2 static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  SPEC_EXT_AVX2 static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <int MR, int NP, int NR>
  SPEC_EXT_AVX2 static inline void trees(const V (&acc)[MR][NP], float* t) {
    trees_avx2<MR * NR>(&acc[0][0], t);
  }
};

struct Avx512Ops {
  using V = __m512;
  static constexpr int rows = 2;
  SPEC_EXT_AVX512 static inline V zero() { return _mm512_setzero_ps(); }
  SPEC_EXT_AVX512 static inline V load_w(const float* a, const float* c) {
    const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
    return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(c)), 1));
  }
  // 8 16-bit weights of row a in the low half, 8 of row c in the high half
  template <typename W>
  SPEC_EXT_AVX512 static inline __m256i pair16(const W* a, const W* c) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), 1);
  }
  SPEC_EXT_AVX512 static inline V load_w(const bf16* a, const bf16* c) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pair16(a, c)), 16));
  }
  SPEC_EXT_AVX512 static inline V load_w(const f16* a, const f16* c) { return _mm512_cvtph_ps(pair16(a, c)); }
  template <typename X>
  SPEC_EXT_AVX512 static inline V load_x(const X* p) {  // the AVX2 path's 8 floats, in both halves
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(Avx2Ops::load_x(p))));
  }
  SPEC_EXT_AVX512 static inline V fma(V w, V x, V acc) { return _mm512_fmadd_ps(w, x, acc); }
  SPEC_EXT_AVX512 static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  SPEC_EXT_AVX512 static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <int MR, int NP, int NR>
  SPEC_EXT_AVX512 static inline void trees(const V (&acc)[MR][NP], float* t) {
    __m256 halves[MR * NR];  // row n + r's 8 lanes, in the AVX2 path's order
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) {
        const __m512 v = acc[i][r / 2];
        halves[i * NR + r] =
            r % 2 == 0 ? _mm512_castps512_ps256(v) : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
      }
    trees_avx2<MR * NR>(halves, t);
  }
};

// ------------------------------------------------------------------ AVX2 + FMA
struct Avx2 {
  static constexpr int max_rows = 4, max_cols = 8;
  static constexpr bool prefetches = true;
  static constexpr int padded(int nr) { return nr; }
  // 12 accumulators of the 16 ymm registers where there are rows for it
  static std::pair<int, int> plan(int64_t M) { return plan_16_registers(M); }
  template <int MR, int NR, typename X, typename W>
  SPEC_EXT_AVX2 SPEC_EXT_FLATTEN static void block(const Block<X, W>& b, int64_t m0, int64_t n) {
    block_body<Avx2Ops, MR, NR, X, W>(b, m0, n);
  }
};

// ------------------------------------------------------------------ AVX-512
struct Avx512 {
  static constexpr int max_rows = 8, max_cols = 8;
  static constexpr bool prefetches = true;
  static constexpr int padded(int nr) { return nr + nr % 2; }  // partial sums of whole pairs
  // up to 4 rows of x: 8 weight rows (4 pairs a row, 4-16 accumulators of the 32 zmm); more: the
  // rows in as few register blocks of up to 8 as there can be, 6 or 8 weight rows (up to 24
  // accumulators). Measured (AMD EPYC Zen 4, one thread) against 4 x 8 blocks: 16384 -> 320 at
  // 6 / 8 / 16 rows 1.45x / 1.35x / 1.1x faster; 320 -> 16384 at 8-12 rows 1.08x slower, where
  // the AVX2 path is faster anyway
  static std::pair<int, int> plan(int64_t M) {
    if (M <= 4) return {static_cast<int>(M), 8};
    const int64_t blocks = (M + 7) / 8, mr = (M + blocks - 1) / blocks;
    return {static_cast<int>(mr), mr <= 6 ? 8 : 6};
  }
  template <int MR, int NR, typename X, typename W>
  SPEC_EXT_AVX512 SPEC_EXT_FLATTEN static void block(const Block<X, W>& b, int64_t m0, int64_t n) {
    block_body<Avx512Ops, MR, NR, X, W>(b, m0, n);
  }
};
#endif

// block<MR, NR> of a path by run-time MR (1..max_rows) and NR (1..max_cols)
template <class Path, typename X, typename W>
struct Blocks {
  using Fn = void (*)(const Block<X, W>&, int64_t, int64_t);
  Fn table[Path::max_rows][Path::max_cols];

  template <int MR, int... NR>
  void fill_row(std::integer_sequence<int, NR...>) {
    ((table[MR - 1][NR] = &Path::template block<MR, NR + 1, X, W>), ...);
  }
  template <int... MR>
  void fill(std::integer_sequence<int, MR...>) {
    (fill_row<MR + 1>(std::make_integer_sequence<int, Path::max_cols>{}), ...);
  }
  Blocks() { fill(std::make_integer_sequence<int, Path::max_rows>{}); }
  void operator()(int mr, int nr, const Block<X, W>& b, int64_t m0, int64_t n) const { table[mr - 1][nr - 1](b, m0, n); }
};

// K chunks (more rows of x than one register block, long rows): M rows x (at most this many
// floats) of x stay near L1 while the weight rows of a tile go by; the partial sums of one tile
// of weight rows wait between chunks in at most about kTileFloats floats (M x tile x 8, L1/L2).
// Measured (16384 -> 320, 8 and 16 rows, AVX2, one thread, loaded machine): 8192 / 8192 beat
// 4096 (a 256-wide chunk at 16 rows: 1.5-2x slower) and a 2048- or 65536-float tile
constexpr int64_t kChunkFloats = 8192;
constexpr int64_t kTileFloats = 8192;
#if defined(__x86_64__)
// Software prefetch keeps memory busy while the other row blocks of x reuse a weight block from
// L1 (without it, 8 rows of 320 -> 16384 took the memory time plus the arithmetic of the second
// row block: 1.9 ms against 0.8 ms for one row). Rows of a few KB are short streams for the
// hardware prefetcher, so:
// - unchunked, contiguous rows: a block of NR rows is one contiguous span; the register blocks
//   of one weight block prefetch, in turn, the bytes that follow it from a lead beyond the next
//   block (a stream pointer, each taking 1 / row_blocks of the span): measured a 2 KB lead >
//   1 KB, 8 KB (AMD EPYC, AVX2, 320 -> 16384, one row), and every row block taking its share >
//   the first alone (8 and 16 rows: 1.3-1.4x faster, AVX2 and AVX-512). The stream goes into L2
//   (T2), not L1 (T0): the L1 keeps the block being computed, and its few miss buffers are not
//   held by lines that are a block ahead. Measured (AMD EPYC Zen 4, one thread, 16 matrices of
//   320 -> 16384 read from memory, fastest of 5, both hints interleaved in one process), ms per
//   matrix at 1 / 4 / 5 / 8 / 16 rows: AVX-512 T0 1.40 / 1.66 / 1.90 / 2.17 / 2.66, T2 1.14 /
//   1.03 / 1.05 / 1.39 / 2.45; AVX2 T0 1.09 / 1.12 / 1.34 / 1.59 / 2.57, T2 1.05 / 1.16 / 1.35 /
//   1.54 / 2.62.
// - chunked: the weight rows of what comes next (the tile's next register block in this k
//   chunk, else its first in the next chunk), each row's chunk shared out the same way (16384
//   -> 320, 8 and 16 rows, AVX2: 1.15-1.35x faster; AVX-512, bound by arithmetic there: same).
// Long unchunked rows (a block over 32 KB) are long streams, which the hardware prefetcher
// follows (a software prefetch a block ahead of 4 x 64 KB rows slowed the 16384 -> 320 down
// projection at one row of x by 1.25x). With kAheadRows or more rows of x the arithmetic between
// a row's lines leaves the hardware prefetcher behind: each row of the block is prefetched into
// L2 kPrefetchMargin bytes ahead of where the block reads it (`next`, one line a row as the
// block enters it). Measured (AMD EPYC Zen 4, AVX-512, one thread, 16 matrices of 16384 -> 320
// read from memory, fastest of 7, on and off interleaved in one process), ms per matrix at 1 / 2
// / 3 / 4 / 5 / 8 rows: off 0.77 / 0.79 / 0.85 / 0.91-0.94 / 0.91-0.97 / 1.16-1.25, on (1-2 KB
// ahead) 0.75-0.81 / 0.78-0.85 / 0.79-0.82 / 0.79-0.85 / 0.79-0.80 / 0.99-1.06; 512 bytes ahead
// gained nothing, 8 KB less. The chunked rows' `next` goes into L2 too (T0 and T2 measured the same).
constexpr int64_t kPrefetchMargin = 2048;
constexpr int64_t kAheadRows = 3;
constexpr int64_t kPrefetchBlockBytes = 32 << 10;
#endif

// y[:, n0:n1] for every row of x; n0 is a multiple of the plan's NR.
//
// Short rows (K8 <= 2 chunks) or at most one row block: one pass over k per register block,
// the partial sums in registers throughout. Long rows with several row blocks: the weight
// rows go by in tiles of a few register blocks; for each K chunk every register block of the
// tile is read from memory once (by the first row block) and from L1 by the other row blocks,
// the x chunk stays in L1 across the tile, and the tile's partial sums (M x tile x 8 floats)
// wait in a small buffer between chunks (L1): nothing grows with N.
template <class Path, typename X, typename W>
void columns(const X* x, int64_t ldx, const W* w, int64_t ldw, const float* bias, X* y, int64_t M,
             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  static const Blocks<Path, X, W> blocks;
  const auto [MR, NR] = Path::plan(M);
  const int64_t K8 = K - K % 8;
  int64_t chunk = M <= MR ? K8 : std::max<int64_t>(128, (kChunkFloats / M) / 8 * 8);
  if (K8 <= 2 * chunk) chunk = K8;  // a buffered pass costs more than it saves
  chunk = std::max<int64_t>(chunk, 8);
  const bool chunked = K8 > chunk;
  const int64_t tile =
      chunked ? NR * std::max<int64_t>(1, kTileFloats / (M * Path::padded(NR) * 8)) : NR;
  std::vector<float> partial;
  if (chunked) partial.resize(static_cast<size_t>(tile * M * 8));
  Block<X, W> b{x, ldx, w, ldw, y, N, bias, K, 0, 0, true, true, nullptr, nullptr, 0, 0, nullptr, 0, 0, 0, 0};
#if defined(__x86_64__)
  const int64_t row_blocks = (M + MR - 1) / MR;
  const bool stream = Path::prefetches && ldw == K && !chunked &&
                      NR * K * static_cast<int64_t>(sizeof(W)) <= kPrefetchBlockBytes;
  const bool rowwise = Path::prefetches && chunked && NR * chunk * static_cast<int64_t>(sizeof(W)) <= kPrefetchBlockBytes;
  const bool rows_ahead = Path::prefetches && !chunked && !stream && row_blocks == 1 && M >= kAheadRows;
  // under a line per step, the stream prefetches its current line again each step: gating it to
  // the steps that enter a new line measured 5% slower at 8 rows of 320 -> 16384 (AVX2), 4-8%
  // faster at 16: left as is
  b.prefetch_step = static_cast<int64_t>(NR * 8 * sizeof(W)) / row_blocks;
  b.prefetch_lines = static_cast<int>((b.prefetch_step + 63) / 64);
  b.next_step = std::max<int64_t>(1, 8 * static_cast<int64_t>(sizeof(W)) / row_blocks);
  b.next_ldw = ldw * static_cast<int64_t>(sizeof(W));
#endif
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t k0 = 0; k0 == 0 || k0 < K8; k0 += chunk) {
      b.k0 = k0;
      b.k1 = std::min(K8, k0 + chunk);
      b.first = k0 == 0;
      b.last = b.k1 == K8;
      for (int64_t n = t0; n < t1; n += NR) {
        const int nr = static_cast<int>(std::min<int64_t>(NR, t1 - n));
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, M - m0));
          if (chunked) b.partial = partial.data() + ((n - t0) * M + m0 * Path::padded(nr)) * 8;
#if defined(__x86_64__)
          const int64_t share = m0 / MR * ((b.k1 - b.k0) / 8);  // k steps of the row blocks before
          // an address only (it may lie past the weights: a prefetch never faults)
          const uintptr_t ahead = reinterpret_cast<uintptr_t>(w + n * ldw) + kPrefetchMargin + NR * K * sizeof(W) +
                                  share * b.prefetch_step;
          b.prefetch = stream ? reinterpret_cast<const char*>(ahead) : nullptr;
          int64_t next_n = n + nr, next_k = b.k0;
          if (next_n >= t1) next_n = t0, next_k = b.k1;
          const int64_t next_rows = next_k < K8 ? std::min<int64_t>(NR, t1 - next_n) : 0;
          b.next = rowwise && next_rows > 0 ? reinterpret_cast<const char*>(w + next_n * ldw + next_k) : nullptr;
          b.next_rows = static_cast<int>(next_rows);
          b.next_offset = share * b.next_step;
          if (rows_ahead) {  // the block's own rows, kPrefetchMargin bytes ahead of where it reads them
            b.next = reinterpret_cast<const char*>(w + n * ldw) + kPrefetchMargin;
            b.next_rows = nr;
            b.next_offset = 0;
          }
#endif
          blocks(mr, nr, b, m0, n);
        }
      }
    }
  }
}

template <class Path, typename X, typename W>
void run(const X* x, int64_t ldx, const W* w, int64_t ldw, const float* bias, X* y, int64_t M, int64_t N,
         int64_t K) {
  const int64_t NR = Path::plan(M).second;
  const int64_t groups = (N + NR - 1) / NR;
  // a task takes at least 64 KB of weights, so a thread's wake-up pays
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, K * static_cast<int64_t>(sizeof(W)) * NR));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    columns<Path, X, W>(x, ldx, w, ldw, bias, y, M, N, K, g0 * NR, std::min(N, g1 * NR));
  });
}

enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

Isa supported_isa() {
#if defined(__x86_64__)
  static const Isa best = !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c") ? Isa::portable
                          : __builtin_cpu_supports("avx512f") ? Isa::avx512
                          : __builtin_cpu_supports("avx2")    ? Isa::avx2
                                                              : Isa::portable;
  return best;
#else
  return Isa::portable;
#endif
}

// The best path this CPU has, or a lower one that SPEC_EXT_CPU_ISA asks for (read at every
// call, so that tests and benchmarks can force each path in one process).
Isa chosen_isa() {
  const char* forced = std::getenv("SPEC_EXT_CPU_ISA");
  if (forced == nullptr || *forced == '\0') return supported_isa();
  const std::string name(forced);
  TORCH_CHECK(name == "portable" || name == "avx2" || name == "avx512",
              "SPEC_EXT_CPU_ISA must be portable, avx2 or avx512, got '", name, "'");
  const Isa wanted = name == "portable" ? Isa::portable : name == "avx2" ? Isa::avx2 : Isa::avx512;
  return std::min(wanted, supported_isa());
}

// With AVX-512 the AVX2 path is not always the slower one: on AMD Zen 4 (a 512-bit FMA runs as
// two 256-bit halves) AVX2 measured 1.2-1.5x faster on 320 -> 16384 at 4-16 rows and AVX-512
// 1.2-1.6x faster on 16384 -> 320 (one thread, calls interleaved). Both give the same bits, so
// unless SPEC_EXT_CPU_ISA forces a path, the first calls of each shape (rows, N, K, weight
// dtype) alternate between the two, timed, kTrials each, and later calls take the faster.
class PathChooser {
 public:
  static constexpr int kTrials = 3;
  using Key = std::tuple<int64_t, int64_t, int64_t, int>;  // M, N, K, the Types (x, weight)
  struct Entry {
    int trials[2] = {0, 0};  // [avx2, avx512]
    double best[2] = {0, 0};
    int chosen = -1;
  };

  // the path for this call of `key`, and whether the call is a timed trial
  std::pair<Isa, bool> next(const Key& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Entry& e = entries_[key];
    if (e.chosen >= 0) return {path(e.chosen), false};
    return {path(e.trials[1] <= e.trials[0] ? 1 : 0), true};
  }
  void record(const Key& key, Isa isa, double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[key];
    const int p = isa == Isa::avx512 ? 1 : 0;
    e.best[p] = e.trials[p] == 0 ? seconds : std::min(e.best[p], seconds);
    if (++e.trials[p] >= kTrials && e.trials[1 - p] >= kTrials && e.chosen < 0) e.chosen = e.best[1] <= e.best[0];
  }
  std::vector<std::pair<Key, Entry>> entries() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {entries_.begin(), entries_.end()};
  }

 private:
  static Isa path(int p) { return p == 1 ? Isa::avx512 : Isa::avx2; }
  std::mutex mutex_;
  std::map<Key, Entry> entries_;
};

PathChooser& path_chooser() {
  static PathChooser chooser;
  return chooser;
}

template <typename X, typename W>
void dispatch(Isa isa, const X* x, int64_t ldx, const W* w, int64_t ldw, const float* bias, X* y, int64_t M,
              int64_t N, int64_t K) {
#if defined(__x86_64__)
  if (isa == Isa::avx512) return run<Avx512, X, W>(x, ldx, w, ldw, bias, y, M, N, K);
  if (isa == Isa::avx2) return run<Avx2, X, W>(x, ldx, w, ldw, bias, y, M, N, K);
#endif
  run<Portable, X, W>(x, ldx, w, ldw, bias, y, M, N, K);
}

}  // namespace

const char* const kIsaNames[] = {"portable", "avx2", "avx512"};

// The (x, weight) dtypes the kernel takes, and the names skinny_linear_choices gives them
enum class Types { f32_f32 = 0, f32_bf16 = 1, bf16_bf16 = 2, f16_f16 = 3, f32_f16 = 4 };
const char* const kTypeNames[] = {"float32", "bfloat16", "bfloat16 (x bfloat16)", "float16 (x float16)", "float16"};

// y[m, n] = x[m] . w[n] in skinny_linear's order (see skinny_linear.h), on the path skinny_linear
// would force or the best one (no timing: every path gives these bits)
void fixed_order_products(const float* x, int64_t ldx, const void* w, at::ScalarType w_type, int64_t ldw, float* y,
                          int64_t M, int64_t N, int64_t K) {
  TORCH_CHECK(w_type == at::kFloat || w_type == at::kBFloat16 || w_type == at::kHalf,
              "fixed_order_products: w must be float32, bfloat16 or float16, got ", w_type);
  if (M == 0 || N == 0) return;
  const Isa isa = chosen_isa();
  if (w_type == at::kBFloat16) return dispatch(isa, x, ldx, static_cast<const bf16*>(w), ldw, nullptr, y, M, N, K);
  if (w_type == at::kHalf) return dispatch(isa, x, ldx, static_cast<const f16*>(w), ldw, nullptr, y, M, N, K);
  dispatch(isa, x, ldx, static_cast<const float*>(w), ldw, nullptr, y, M, N, K);
}

// "avx512", "avx2" or "portable": the best path skinny_linear may take now, the CPU's or the one
// SPEC_EXT_CPU_ISA forces (spec_ext._C.skinny_linear_isa); with AVX-512 unforced, each shape
// takes AVX2 or AVX-512 as PathChooser measured
const char* skinny_linear_isa() { return kIsaNames[static_cast<int>(chosen_isa())]; }

// PathChooser's entries (spec_ext._C.skinny_linear_choices)
std::vector<SkinnyLinearChoice> skinny_linear_choices() {
  std::vector<SkinnyLinearChoice> rows;
  for (const auto& [key, e] : path_chooser().entries()) {
    const auto& [M, N, K, types] = key;
    rows.push_back({M, N, K, kTypeNames[types], e.chosen < 0 ? "" : kIsaNames[e.chosen + 1],
                    e.trials[0] > 0 ? e.best[0] * 1e6 : -1.0, e.trials[1] > 0 ? e.best[1] * 1e6 : -1.0});
  }
  return rows;
}

at::Tensor skinny_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                             const std::optional<at::Tensor>& bias_in) {
  const auto xt = x_in.scalar_type(), wt = weight_in.scalar_type();
  TORCH_CHECK((xt == at::kFloat && (wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf)) ||
                  (xt == at::kBFloat16 && wt == at::kBFloat16) || (xt == at::kHalf && wt == at::kHalf),
              "skinny_linear: x float32 and weight float32, bfloat16 or float16, or x and weight both bfloat16 or "
              "both float16, got ", xt, " and ", wt);
  const Types types = xt == at::kBFloat16   ? Types::bf16_bf16
                      : xt == at::kHalf     ? Types::f16_f16
                      : wt == at::kBFloat16 ? Types::f32_bf16
                      : wt == at::kHalf     ? Types::f32_f16
                                            : Types::f32_f32;
  TORCH_CHECK(x_in.dim() >= 1 && weight_in.dim() == 2 && x_in.size(-1) == weight_in.size(1),
              "skinny_linear: expected x [..., K] and weight [N, K], got ", x_in.sizes(), " and ", weight_in.sizes());
  TORCH_CHECK(!bias_in || (bias_in->dim() == 1 && bias_in->size(0) == weight_in.size(0) &&
                           (bias_in->scalar_type() == at::kFloat || bias_in->scalar_type() == weight_in.scalar_type())),
              "skinny_linear: bias must be [N] = [", weight_in.size(0), "], float32 or the weight's dtype");
  const int64_t K = weight_in.size(1), N = weight_in.size(0);
  // rows may be strided (a view), elements must be adjacent
  auto weight = weight_in.stride(1) == 1 && weight_in.stride(0) >= K ? weight_in : weight_in.contiguous();
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x_in.dim(); ++d) M *= x_in.size(d);
  auto x = x_in.reshape({M, K});
  if (x.stride(1) != 1 || x.stride(0) < K) x = x.contiguous();
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(sizes);
  at::Tensor bias;
  if (bias_in) bias = bias_in->to(at::kFloat).contiguous();
  const float* bp = bias_in ? bias.data_ptr<float>() : nullptr;
  const int64_t ldx = M > 1 ? x.stride(0) : K, ldw = N > 1 ? weight.stride(0) : K;
  auto compute = [&](Isa isa) {
    switch (types) {
      case Types::f32_f32:
        return dispatch(isa, x.data_ptr<float>(), ldx, weight.data_ptr<float>(), ldw, bp, y.data_ptr<float>(), M, N, K);
      case Types::f32_bf16:
        return dispatch(isa, x.data_ptr<float>(), ldx, weight.data_ptr<bf16>(), ldw, bp, y.data_ptr<float>(), M, N, K);
      case Types::bf16_bf16:
        return dispatch(isa, x.data_ptr<bf16>(), ldx, weight.data_ptr<bf16>(), ldw, bp, y.data_ptr<bf16>(), M, N, K);
      case Types::f16_f16:
        return dispatch(isa, x.data_ptr<f16>(), ldx, weight.data_ptr<f16>(), ldw, bp, y.data_ptr<f16>(), M, N, K);
      case Types::f32_f16:
        return dispatch(isa, x.data_ptr<float>(), ldx, weight.data_ptr<f16>(), ldw, bp, y.data_ptr<float>(), M, N, K);
    }
  };
  const char* forced = std::getenv("SPEC_EXT_CPU_ISA");
  if ((forced != nullptr && *forced != '\0') || supported_isa() != Isa::avx512) {
    compute(chosen_isa());
    return y.view(sizes);
  }
  const PathChooser::Key key{M, N, K, static_cast<int>(types)};
  const auto [isa, timed] = path_chooser().next(key);
  const auto start = std::chrono::steady_clock::now();
  compute(isa);
  if (timed)
    path_chooser().record(key, isa, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return y.view(sizes);
}

TORCH_LIBRARY_IMPL(spec_ext, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }

}  // namespace spec_ext
