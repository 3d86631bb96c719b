// Token-window shift for repetition-aware sampling, in place and CUDA-graph safe.
//   buf    int32 [max_slots, W, C]: per slot, the last W columns of C ints (oldest first)
//   slots  int64 [B]: the slot of each batch row (padded rows point at a frozen scratch slot)
//   next   int32 [B, C]: the newest column of each row
//   active uint8 [B]: rows with 0 are left untouched (finished or padded streams)
// Each active row's window moves left by one and `next` becomes column W-1. One block per row; W*C <= blockDim.
#include "common.cuh"

extern "C" __global__ void token_window_shift(int* __restrict__ buf, const i64* __restrict__ slots,
                                              const int* __restrict__ next, const unsigned char* __restrict__ active,
                                              int W, int C) {
    const int b = blockIdx.x;
    if (!active[b]) return;
    int* win = buf + slots[b] * (i64)W * C;
    const int i = threadIdx.x;
    const int n = W * C;
    int v = 0;
    if (i < n) {
        const int w = i / C, c = i - w * C;
        v = (w < W - 1) ? win[(w + 1) * C + c] : next[b * C + c];
    }
    __syncthreads();  // every read of the old window happens before any write
    if (i < n) win[i] = v;
}
