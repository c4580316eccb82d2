// Forward kernels for fp16, head dims up to 64.
#define DMATTN_FWD_LAUNCH_IMPL
#include "cuda/host/fwd_launch.h"

DMATTN_INSTANTIATE_FWD(cutlass::half_t, 64)
