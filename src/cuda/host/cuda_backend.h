// Entry points of the CUDA sm80-class backend (mma.sync kernels; also run on sm90).
// Called by the dispatcher in src/api/ with validated params.
#pragma once

#include "dmattn/params.h"

namespace dmattn::cuda {

// Throws dmattn::Error(kValue) for an unsupported head dim, kRuntime for a CUDA error.
void forward(const ForwardParams& p);
void backward(const BackwardParams& p);

}  // namespace dmattn::cuda
