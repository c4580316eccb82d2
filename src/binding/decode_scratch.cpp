// A decoding step that starts from an idle GPU waits for the host's work before its first launch,
// and the splits' workspace is allocated before it (the output after it). Through the environment
// allocator (torch's caching allocator, behind DLPack and tvm-ffi's wrapping) that allocation is
// microseconds of that wait, every step. So eager calls keep one buffer per (device, stream) and
// reuse it: the stream runs each call's kernels after the previous call's, so no call's partial
// rows are overwritten while another reads them (a decode kernel is an ordinary launch after the
// previous call's merge; only the merge is a programmatic dependent, of its own call's kernel).
// Not reused, allocated per call:
// - while the stream captures a CUDA graph: a replay's kernels run at no fixed point of the
//   stream's order, and the allocator gives the graph's calls memory of the graph's own pool;
// - above kMaxReusedElements (a call that large spends far longer in its kernels than in one
//   allocation, and the buffer would hold that much memory for good);
// - with DMATTN_DECODE_SCRATCH=0 in the environment (comparisons).
// tvm-ffi releases Python's GIL during a call, so two threads may run decoding calls on one stream
// at once (threads share their device's default stream), and their launches could interleave: one
// call's decode kernel between another's and its merge would overwrite the other's partial rows.
// So a call holds the buffers' lock from taking its buffer until its last launch is queued
// (DecodeScratch::hold): calls that reuse buffers queue their launches one call at a time, a few
// microseconds each; their kernels still run as the streams allow.
// A smaller buffer is replaced by a larger one (rounded up to a power of two, so that alternating
// shapes settle); the old one goes back to the allocator, which gives its memory to later
// allocations on the same stream only, after the work queued before them.
#include "decode_scratch.h"

#include <tvm/ffi/extra/c_env_api.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "dmattn/api.h"

namespace dmattn::binding {

namespace {

constexpr int64_t kMaxReusedElements = int64_t(1) << 22;  // 16 MiB of float32
constexpr size_t kMaxStreams = 8;  // (the oldest entry makes room for a ninth stream)

struct Reused {
  int32_t device_id;
  void* stream;
  int64_t elements;
  tvm::ffi::Tensor tensor;
};

tvm::ffi::Tensor allocate(int64_t elements, DLDevice device) {
  return tvm::ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, {elements}, DLDataType{kDLFloat, 32, 1}, device);
}

int64_t rounded_up(int64_t elements) {
  int64_t size = 1024;
  while (size < elements) size *= 2;
  return size;
}

bool reuse_allowed() {
  static const bool allowed = [] {
    const char* e = std::getenv("DMATTN_DECODE_SCRATCH");
    return e == nullptr || std::string(e) != "0";
  }();
  return allowed;
}

}  // namespace

DecodeScratch decode_scratch(int64_t elements, DLDevice device, void* stream) {
  DecodeScratch taken;
  if (device.device_type != kDLCUDA || elements > kMaxReusedElements || !reuse_allowed() ||
      dmattn::stream_capturing(stream)) {
    taken.tensor = allocate(elements, device);
    return taken;
  }
  // (never destroyed: at the process's exit the allocator a destructor would call may be gone)
  static auto* lock = new std::mutex;
  static auto* buffers = new std::vector<Reused>;
  taken.hold = std::unique_lock<std::mutex>(*lock);
  auto it = std::find_if(buffers->begin(), buffers->end(), [&](const Reused& r) {
    return r.device_id == device.device_id && r.stream == stream;
  });
  if (it != buffers->end() && it->elements >= elements) {
    taken.tensor = it->tensor;
    return taken;
  }
  const int64_t size = std::min(rounded_up(elements), kMaxReusedElements);
  taken.tensor = allocate(size, device);
  if (it != buffers->end()) {
    it->elements = size, it->tensor = taken.tensor;
  } else {
    if (buffers->size() == kMaxStreams) buffers->erase(buffers->begin());
    buffers->push_back({device.device_id, stream, size, taken.tensor});
  }
  return taken;
}

}  // namespace dmattn::binding
