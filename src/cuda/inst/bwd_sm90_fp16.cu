// The general Hopper backward for fp16, head dim 128 (bwd_sm90_launch.h).
#define DMATTN_BWD_SM90_LAUNCH_IMPL
#include "cuda/host/bwd_sm90_launch.h"

DMATTN_INSTANTIATE_BWD_SM90(cutlass::half_t)
