// Snake activation of the codec, y = x + sin(alpha_c x)^2 / (alpha_c + 1e-9), in one pass.
//   x      [B, C, L] (float32, raw bfloat16 or raw float16 bits) whose rows (one channel of one batch entry) are
//          contiguous and x_row elements apart: a contiguous tensor (x_row = L) or a slice of one along L, as the
//          streamed transposed convolution leaves its output
//   y      [B, C, L] contiguous, distinct from x
//   alpha  float32 [C]
//   bias   float32 [C] or null: added to x first, so the convolution before runs without its bias (torch adds a
//          conv's bias as a pass of its own) and y = snake(x + bias)
// torch spells it as five elementwise kernels over the whole tensor (alpha * x, sin, pow, the broadcast multiply,
// the add), each a full read and write: 29 of them per codec decode are ~40% of a streaming chunk's GPU time. Here
// each element is read once and written once. Math in float32 in torch's order (sinf, not __sinf: the arguments are
// not small), so float32 results match the reference to the last bit or so.
// Each thread takes VEC consecutive elements of one row (the wrapper picks VEC = 4 only when L and x_row are multiples
// of 4 and the pointers are 16-byte aligned, so a vector never straddles two channels).
#include "codec_vec.cuh"

__device__ __forceinline__ float snake_value(float v, float a, float inv) {
    const float s = sinf(a * v);
    return v + inv * (s * s);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) snake(const T* __restrict__ x, const float* __restrict__ alpha,
                                             const float* __restrict__ bias, T* __restrict__ y, i64 n, int C, int L,
                                             i64 x_row) {
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    // (32-bit division where the tensor allows it: a 64-bit one is ~3x the instructions, per thread)
    i64 row, col;
    int c;
    if (n <= 0xFFFFFFFFll) {
        const unsigned r = (unsigned)i / (unsigned)L;
        row = r; col = (unsigned)i - r * (unsigned)L; c = (int)(r % (unsigned)C);
    } else {
        row = i / L; col = i - row * L; c = (int)(row % C);
    }
    const float a = alpha[c];
    const float inv = 1.0f / (a + 1e-9f);  // torch: (alpha + 1e-9).reciprocal(), correctly rounded in both
    const float b = bias != nullptr ? bias[c] : 0.0f;
    float v[VEC];
    load_vec<VEC>(x + row * x_row + col, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = snake_value(v[j] + b, a, inv);
    store_vec<VEC>(y + i, v);
}

// The same activation between a dilated convolution's input and output in phase layout (rtts/model/codec_conv.py
// runs a dilation-d conv as an undilated conv over the d interleaved phases of its input): position q of a [B, C, *]
// signal lives at [b * d + q % d, c, q / d] of a [B * d, C, J] tensor. One element per thread, in the order of the
// tensor written, so writes coalesce and reads stride (L2 catches the reuse). These replace three full copies (the
// causal context's concatenation, the right padding, the permute into phases) before the conv and one (the permute
// back) after it.

// y (phase layout [B * d, C, J]) at positions y0 .. y0 + L - 1 <- snake(x + bias), x [B, C, L] with rows x_row apart.
// n = B * d * C * J; threads on other positions (the context before y0, the padding after) write nothing.
template <typename T>
__global__ void __launch_bounds__(256) snake_to_phases(const T* __restrict__ x, const float* __restrict__ alpha,
                                                       const float* __restrict__ bias, T* __restrict__ y, i64 n,
                                                       int C, int L, i64 x_row, int d, int J, int y0) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    i64 b;
    int j, c, p;
    if (n <= 0xFFFFFFFFll) {  // 32-bit divisions where the tensor allows it
        const unsigned u = (unsigned)i, r = u / (unsigned)J, bp = r / (unsigned)C;  // r = (b * d + p) * C + c
        j = (int)(u - r * (unsigned)J); c = (int)(r - bp * (unsigned)C); p = (int)(bp % (unsigned)d); b = bp / (unsigned)d;
    } else {
        const i64 r = i / J, bp = r / C;
        j = (int)(i - r * J); c = (int)(r - bp * C); p = (int)(bp % d); b = bp / d;
    }
    const int t = j * d + p - y0;
    if (t < 0 || t >= L) return;
    const float a = alpha[c];
    const float inv = 1.0f / (a + 1e-9f);
    const float bb = bias != nullptr ? bias[c] : 0.0f;
    float v[1];
    load_vec<1>(x + (b * C + c) * x_row + t, v);
    v[0] = snake_value(v[0] + bb, a, inv);
    store_vec<1>(y + i, v);
}

// y [B, C, L] contiguous <- snake(x + bias) of x in phase layout [B * d, C, J] (positions 0 .. L - 1). n = B * C * L.
template <typename T>
__global__ void __launch_bounds__(256) snake_from_phases(const T* __restrict__ x, const float* __restrict__ alpha,
                                                         const float* __restrict__ bias, T* __restrict__ y, i64 n,
                                                         int C, int L, int d, int J) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    i64 b;
    int t, c;
    if (n <= 0xFFFFFFFFll) {  // 32-bit divisions where the tensor allows it
        const unsigned u = (unsigned)i, r = u / (unsigned)L;  // r = b * C + c
        t = (int)(u - r * (unsigned)L); b = r / (unsigned)C; c = (int)(r - (unsigned)b * (unsigned)C);
    } else {
        const i64 r = i / L;
        t = (int)(i - r * L); b = r / C; c = (int)(r - b * C);
    }
    const float a = alpha[c];
    const float inv = 1.0f / (a + 1e-9f);
    const float bb = bias != nullptr ? bias[c] : 0.0f;
    float v[1];
    load_vec<1>(x + ((b * d + (unsigned)t % (unsigned)d) * C + c) * J + (unsigned)t / (unsigned)d, v);
    v[0] = snake_value(v[0] + bb, a, inv);
    store_vec<1>(y + i, v);
}
