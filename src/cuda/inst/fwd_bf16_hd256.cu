// Forward kernels for bf16, head dims up to 256.
#define DMATTN_FWD_LAUNCH_IMPL
#include "cuda/host/fwd_launch.h"

DMATTN_INSTANTIATE_FWD(cutlass::bfloat16_t, 256)
