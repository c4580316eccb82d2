// The warp-specialized Hopper forward for bf16, head dims up to 64 (fwd_launch.h).
#define DMATTN_FWD_LAUNCH_IMPL
#include "cuda/host/fwd_launch.h"

DMATTN_INSTANTIATE_FWD_WS(cutlass::bfloat16_t, 64)
