// Whether a stream is capturing a CUDA graph (dmattn::stream_capturing in dmattn/api.h).
#pragma once

namespace dmattn::cuda {

// `stream` a cudaStream_t; true where the runtime cannot tell.
bool stream_capturing(void* stream);

}  // namespace dmattn::cuda
