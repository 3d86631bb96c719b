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

// One element of channel c, its bias (if any) added first.
__device__ __forceinline__ float snake_of(float v, const float* alpha, const float* bias, int c) {
    const float a = alpha[c];
    return snake_value(v + (bias != nullptr ? bias[c] : 0.0f), a, 1.0f / (a + 1e-9f));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) snake(const T* __restrict__ x, const float* __restrict__ alpha,
                                             const float* __restrict__ bias, T* __restrict__ y, i64 n, int C, int L,
                                             i64 x_row) {
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    i64 row, col;
    int c;
    row_col_channel(i, n, C, L, row, col, c);
    const float a = alpha[c];
    const float inv = 1.0f / (a + 1e-9f);  // torch: (alpha + 1e-9).reciprocal(), correctly rounded in both
    const float b = bias != nullptr ? bias[c] : 0.0f;
    float v[VEC];
    load_vec<VEC>(x + row * x_row + col, v);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = snake_value(v[j] + b, a, inv);
    store_vec<VEC>(y + i, v);
}

// The same activation between a dilated convolution's input and output in phase layout, channels last (rtts/model/
// codec_conv.py runs a dilation-d conv as an undilated conv over the d interleaved phases of its input, in cuDNN's
// native NHWC layout): position q of a [B, C, *] signal lives at [b * d + q % d, q / d, c] of a [B * d, J, C] tensor.
// These replace, around each such conv, the causal context's concatenation, the right padding, the permutes into and
// out of phases and cuDNN's NCHW <-> NHWC transposes (each a full pass over the activations). The layout change is a
// transpose, so both kernels go through a shared-memory tile of TILE * V positions x TILE * V channels: reads and
// writes both coalesce. Each thread moves V consecutive elements per access (V = 2: the wrapper's choice where C, the
// lengths, the row stride and the pointers are even / aligned; one 2-byte access per thread left these kernels at a
// fraction of the memory bandwidth). Block (TILE, ROWS); grid (ceil(L / (TILE * V)), ceil(C / (TILE * V)), B).
constexpr int TILE = 32, ROWS = 8;

// Where tile index i (a position or a channel) is stored for V = 2: even i in the first half, odd i in the second.
// A warp's accesses step by 2 in i; with both indices permuted they land on 32 distinct banks in both passes (the
// row pitch TILE * V + 1 is 1 mod 32). For V = 1 the identity.
template <int V>
__device__ __forceinline__ int slot(int i) {
    if constexpr (V == 2) return (i & 1) * TILE + (i >> 1);
    return i;
}

// y (phase layout [B * d, J, C]) at positions y0 .. y0 + L - 1 <- snake(x + bias), x [B, C, L] with rows x_row apart;
// other positions keep what they hold.
template <typename T, int V>
__global__ void __launch_bounds__(TILE * ROWS) snake_to_phases(const T* __restrict__ x, const float* __restrict__ alpha,
                                                                const float* __restrict__ bias, T* __restrict__ y,
                                                                int C, int L, i64 x_row, int d, int J, int y0) {
    constexpr int TT = TILE * V;
    __shared__ float tile[TT][TT + 1];  // [channel][position]
    const int t0 = blockIdx.x * TT, c0 = blockIdx.y * TT;
    const i64 b = blockIdx.z;
#pragma unroll
    for (int i = 0; i < TT / ROWS; ++i) {  // read along positions
        const int k = threadIdx.y + i * ROWS, c = c0 + k, t = t0 + threadIdx.x * V;
        if (c < C && t < L) {  // t + V <= L: V divides L and t
            float v[V];
            load_vec<V>(x + (b * C + c) * x_row + t, v);
#pragma unroll
            for (int j = 0; j < V; ++j)
                tile[slot<V>(k)][slot<V>(threadIdx.x * V + j)] = snake_of(v[j], alpha, bias, c);
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TT / ROWS; ++i) {  // write along channels
        const int k = threadIdx.y + i * ROWS, t = t0 + k, c = c0 + threadIdx.x * V;
        if (c < C && t < L) {  // c + V <= C: V divides C and c
            const unsigned q = (unsigned)(y0 + t);
            float v[V];
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] = tile[slot<V>(threadIdx.x * V + j)][slot<V>(k)];
            store_vec<V>(y + ((b * d + q % (unsigned)d) * J + q / (unsigned)d) * C + c, v);
        }
    }
}

// y [B, C, L] contiguous <- snake(x + bias) of the signal x holds in phase layout [B * d, J, C], positions 0 .. L - 1.
template <typename T, int V>
__global__ void __launch_bounds__(TILE * ROWS) snake_from_phases(const T* __restrict__ x,
                                                                  const float* __restrict__ alpha,
                                                                  const float* __restrict__ bias, T* __restrict__ y,
                                                                  int C, int L, int d, int J) {
    constexpr int TT = TILE * V;
    __shared__ float tile[TT][TT + 1];  // [position][channel]
    const int t0 = blockIdx.x * TT, c0 = blockIdx.y * TT;
    const i64 b = blockIdx.z;
#pragma unroll
    for (int i = 0; i < TT / ROWS; ++i) {  // read along channels
        const int k = threadIdx.y + i * ROWS, t = t0 + k, c = c0 + threadIdx.x * V;
        if (c < C && t < L) {  // c + V <= C: V divides C and c
            float v[V];
            load_vec<V>(x + ((b * d + (unsigned)t % (unsigned)d) * J + (unsigned)t / (unsigned)d) * C + c, v);
#pragma unroll
            for (int j = 0; j < V; ++j) tile[slot<V>(k)][slot<V>(threadIdx.x * V + j)] = v[j];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TT / ROWS; ++i) {  // write along positions
        const int k = threadIdx.y + i * ROWS, c = c0 + k, t = t0 + threadIdx.x * V;
        if (c < C && t < L) {  // t + V <= L: V divides L and t
            float v[V];
#pragma unroll
            for (int j = 0; j < V; ++j)
                v[j] = snake_of(tile[slot<V>(threadIdx.x * V + j)][slot<V>(k)], alpha, bias, c);
            store_vec<V>(y + (b * C + c) * (i64)L + t, v);
        }
    }
}
