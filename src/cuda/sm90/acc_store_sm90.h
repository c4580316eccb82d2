// An fp32 wgmma accumulator stored to a shared-memory tile by 8-byte shared stores.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

namespace dmattn::cuda::sm90 {

// acc -> s, where s is the matching partition_C of a shared-memory tile (any of wgmma's
// 128-byte-swizzled fp32 layouts): each thread's two adjacent columns of a row, acc(i) and
// acc(i + 1) for even i, by one st.shared.v2.f32. The pair is 8-byte aligned and never straddles
// the swizzle's 16-byte chunks, so it stays contiguous. CuTe's element-wise copy there compiled
// to generic 4-byte stores through 64-bit addresses (twice the stores, 64-bit address arithmetic
// beside the products, and the stores queued with global memory's): in the dQ staging of the
// warp-specialized backward that was a tenth of the consumers' stall samples under ncu.
template <class TAcc, class TSmem>
__device__ __forceinline__ void store_acc_to_smem(TAcc const& acc, TSmem&& s) {
  using namespace cute;
  static_assert(std::is_same_v<typename std::decay_t<TAcc>::value_type, float>, "an fp32 accumulator");
  static_assert(decltype(size(acc))::value == decltype(size(s))::value, "s must be acc's partition of the tile");
  static_assert(decltype(size(acc))::value % 2 == 0, "column pairs");
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const uint32_t addr = cast_smem_ptr_to_uint(&s(i));
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc(i)), "f"(acc(i + 1)) : "memory");
  }
}

}  // namespace dmattn::cuda::sm90
