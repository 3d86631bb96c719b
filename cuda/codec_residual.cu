// The end of the codec's residual unit, out = x + (y + bias), in one pass.
//   x     [B, C, L] (float32, raw bfloat16 or raw float16 bits), the unit's input: rows contiguous and x_row elements
//         apart (a contiguous tensor, x_row = L, or a slice of one along L)
//   y     [B, C, L] contiguous: the unit's last (k = 1) convolution, run without its bias
//   bias  float32 [C] or null
//   out   [B, C, L] contiguous, distinct from x and y
// torch spends two passes here (the conv's broadcast bias add, then the residual add), each a full read and write;
// this reads x and y once and writes out once. Math in float32, one rounding at the end.
// Each thread takes VEC consecutive elements of one row (VEC = 4 only when L and x_row are multiples of 4 and the
// pointers are 16-byte aligned).
#include "codec_vec.cuh"

template <typename T, int VEC>
__global__ void __launch_bounds__(256) bias_residual(const T* __restrict__ x, const T* __restrict__ y,
                                                     const float* __restrict__ bias, T* __restrict__ out, i64 n,
                                                     int C, int L, i64 x_row) {
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    i64 row, col;
    int c;
    row_col_channel(i, n, C, L, row, col, c);
    const float b = bias != nullptr ? bias[c] : 0.0f;
    float vx[VEC], vy[VEC];
    load_vec<VEC>(x + row * x_row + col, vx);
    load_vec<VEC>(y + i, vy);
#pragma unroll
    for (int j = 0; j < VEC; ++j) vx[j] = vx[j] + (vy[j] + b);
    store_vec<VEC>(out + i, vx);
}
