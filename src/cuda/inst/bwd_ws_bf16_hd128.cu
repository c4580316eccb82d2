// The warp-specialized Hopper backward for bf16, head dims up to 128 (bwd_launch.h).
#define DMATTN_BWD_LAUNCH_IMPL
#include "cuda/host/bwd_launch.h"

DMATTN_INSTANTIATE_BWD_WS(cutlass::bfloat16_t, 128)
