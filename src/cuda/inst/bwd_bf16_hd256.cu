// Backward kernels for bf16, head dims up to 256.
#define DMATTN_BWD_LAUNCH_IMPL
#include "cuda/host/bwd_launch.h"

DMATTN_INSTANTIATE_BWD(cutlass::bfloat16_t, 256)
