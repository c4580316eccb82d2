// The warp-specialized Hopper forward's gate variant for fp16, head dims 64 and 128 (fwd_launch.h).
#define DMATTN_FWD_LAUNCH_IMPL
#include "cuda/host/fwd_launch.h"

DMATTN_INSTANTIATE_FWD_WS_GATE(cutlass::half_t)
