// The sm80-class backward's query-major kernel for fp16, head dims up to 256 (bwd_dq_launch.h).
#define DMATTN_BWD_DQ_LAUNCH_IMPL
#include "cuda/host/bwd_dq_launch.h"

DMATTN_INSTANTIATE_BWD_DQ(cutlass::half_t, 256)
