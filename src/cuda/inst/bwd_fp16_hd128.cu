// Backward kernels for fp16, head dims up to 128.
#define DMATTN_BWD_LAUNCH_IMPL
#include "cuda/host/bwd_launch.h"

DMATTN_INSTANTIATE_BWD(cutlass::half_t, 128)
