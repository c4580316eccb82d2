// Stream-level helpers for the binding's buffers (dmattn::stream_capturing and
// dmattn::clear_device_bytes in dmattn/api.h).
#pragma once

#include <cstdint>

namespace dmattn::cuda {

// `stream` a cudaStream_t; true where the runtime cannot tell.
bool stream_capturing(void* stream);

// `bytes` zero bytes at `ptr` (device memory), queued on `stream`.
void clear_bytes(void* ptr, int64_t bytes, void* stream);

}  // namespace dmattn::cuda
