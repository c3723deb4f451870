// What csrc/cpu/skinny_linear.cpp tells the Python module (csrc/ops.cpp) and the other kernels,
// besides the op.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace spec_ext {
// One shape skinny_linear's path choice has seen (see PathChooser): the best time of each path
// in microseconds (-1: not tried), and the path chosen ("": still trying).
struct SkinnyLinearChoice {
  int64_t rows, n, k;
  const char* weight_dtype;
  const char* chosen;
  double avx2_us, avx512_us;
};

const char* skinny_linear_isa();
std::vector<SkinnyLinearChoice> skinny_linear_choices();

// y[m, n] = x[m] . w[n] for float32 x [M, K] (rows ldx apart) and w [N, K] (rows ldw apart,
// float32, bfloat16 or float16) into float32 y [M, N] (rows N apart): skinny_linear's kernel, so
// each y[m, n] is one dot product in its fixed order (8 interleaved fused partial sums over k,
// a tree, the tail), the same bits whatever M, N, the other rows and the ISA path
// (csrc/cpu/tree_attention.cpp takes its scores from it)
void fixed_order_products(const float* x, int64_t ldx, const void* w, at::ScalarType w_type, int64_t ldw, float* y,
                          int64_t M, int64_t N, int64_t K);
}  // namespace spec_ext
