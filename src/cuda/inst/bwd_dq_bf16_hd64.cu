// The sm80-class backward's query-major kernel for bf16, head dims up to 64 (bwd_dq_launch.h).
#define DMATTN_BWD_DQ_LAUNCH_IMPL
#include "cuda/host/bwd_dq_launch.h"

DMATTN_INSTANTIATE_BWD_DQ(cutlass::bfloat16_t, 64)
