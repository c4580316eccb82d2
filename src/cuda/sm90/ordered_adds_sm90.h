// Reductions into global memory in a fixed order across CTAs (deterministic mode of the
// warp-specialized backward, whose dQ tiles several key blocks add into one fp32 accumulator):
// a flag per target tile holds 1 + the last key block whose adds have landed there. A key block
// waits for its predecessor's value before it issues its TMA reduce-adds, and publishes its own
// once they are complete. fp32 adds in one order give the same bits on every run. One thread of
// the issuing warp calls these.
#pragma once

namespace dmattn::cuda::sm90 {

// The flags of deterministic dQ adds: one per (batch, head, query block of block_m), those of
// (b, h) from (b * heads + h) * dq_order_blocks(seqlen_q, block_m). Shared by the allocation
// (host) and the writer warp's index (device).
__host__ __device__ constexpr int dq_order_blocks(int seqlen_q, int block_m) {
  return (seqlen_q + block_m - 1) / block_m;
}

// Spin until *flag == value (acquire at GPU scope), then order this thread's later bulk (async
// proxy) accesses of global memory after what the flag published.
__device__ __forceinline__ void wait_for_flag(const int* flag, int value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
  } while (seen != value);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// Wait until this thread's bulk stores and reductions have been performed in global memory (not
// only read from shared memory, as tma_store_wait's .read form).
__device__ __forceinline__ void bulk_ops_complete() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// After bulk_ops_complete: *flag = value, released at GPU scope behind those writes.
__device__ __forceinline__ void publish_flag(int* flag, int value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
#endif
}

}  // namespace dmattn::cuda::sm90
