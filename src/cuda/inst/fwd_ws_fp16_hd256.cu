// The warp-specialized Hopper forward for fp16, head dims up to 256 (fwd_launch.h).
#define DMATTN_FWD_LAUNCH_IMPL
#include "cuda/host/fwd_launch.h"

DMATTN_INSTANTIATE_FWD_WS(cutlass::half_t, 256)
