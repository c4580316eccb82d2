// Decode kernels for fp16 (every head-dim bucket and row count: one translation unit).
#define DMATTN_DECODE_LAUNCH_IMPL
#include "cuda/host/decode_launch.h"

DMATTN_INSTANTIATE_DECODE(cutlass::half_t)
