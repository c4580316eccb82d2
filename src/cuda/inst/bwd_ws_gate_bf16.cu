// The warp-specialized Hopper backward's gate variants beside key rows (exact and with gate
// skipping) for bf16, head dims 64 and 128, dense and packed batches (bwd_launch.h).
#define DMATTN_BWD_LAUNCH_IMPL
#include "cuda/host/bwd_launch.h"

DMATTN_INSTANTIATE_BWD_WS_GATE(cutlass::bfloat16_t)
