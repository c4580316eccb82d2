// The gate's logarithm terms in the warp-specialized Hopper kernels, computed ahead of the
// consumers by producer warps that otherwise wait. The forward's form first (warps 2 and 3: the
// gate's variants have no indexed keys for them to gather, fwd_ws_supports), the backward's below.
//   g(x) log2(e) = min(x2, cap) - k log2(1 + 2^-|x2|),  x2 = alpha_i delta_j log2(e)  (GateMath)
// The consumers add s += scale ln2 min(x2, cap) + term themselves, where the term
//   term = -scale ln2 k log2(1 + 2^-|x2|)  (in [-scale ln2, 0]; k = 0 for the linear gate)
// comes from a ring of fp16 slots in shared memory, one slot per (key block, consumer): the
// term's two MUFU operations a score leave the consumers' chain between S and P, and run on
// warps that otherwise wait (docs/design.md, "Gate terms"). The slot holds a consumer's 64 rows
// by kBlockN keys in its accumulators' order: chunk k (16 bytes, 8 terms) of consumer thread u
// at (k * 128 + u) * 16, so that a warp's loads and stores of one chunk are 512 contiguous bytes.
// In chunk k: rows r = 0, 1 of the thread's row/col view at columns 4k .. 4k + 3, as the pairs
// (r0: 4k, 4k+1), (r1: 4k, 4k+1), (r0: 4k+2, 4k+3), (r1: 4k+2, 4k+3).
// Built with DMATTN_GATE_TERM_WARPS=ON (CMake) only, until its figures are measured: otherwise
// the consumers compute the whole gate (add_gate_scores, gate_sm90.h).
// Precision: the logarithm is a polynomial on fp16 pairs (GateTermPairPoly), the exponential one
// MUFU op: the term within 8.4e-5 of a score at scale 1 / sqrt(128). A NaN product gives a NaN
// term (so it reaches its row as on the other paths); a product of +-inf gives 0.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/common/score_terms.h"
#include "cuda/common/utils.h"
#include "cuda/sm90/gmma.h"
#include "cuda/sm90/pipeline_params_sm90.h"

#ifndef DMATTN_GATE_TERM_WARPS
#define DMATTN_GATE_TERM_WARPS 0
#endif
#ifndef DMATTN_GATE_TERM_TURNS
#define DMATTN_GATE_TERM_TURNS 0
#endif

namespace dmattn::cuda::sm90 {

// Whether the gate's variants, forward and backward, take their terms from producer warps.
inline constexpr bool kGateTermWarps = DMATTN_GATE_TERM_WARPS != 0;
// Whether the gate's forward variants with those terms take the tensor-core turns: their
// consumers' transform is then a few instructions a score, no longer longer than the other
// consumer's products (fwd_ws_kernel_sm90.h's kTurns).
inline constexpr bool kGateTermTurns = kGateTermWarps && DMATTN_GATE_TERM_TURNS != 0;

// log2(1 + t) for t in [0, 1] as t p(t), p of degree 4 (a least-maximum-error fit: within 1.5e-5
// of it over [0, 1]), the coefficients times a factor (the term's -scale ln2 k, or 255 k for the
// backward's bytes): five FMAs on the FMA pipes in place of a MUFU op (lg2).
struct GateTermPoly {
  float c1, c2, c3, c4, c5;
  static __device__ __forceinline__ GateTermPoly of(float factor) {
    return {factor * 1.4419655799865723f, factor * -0.7096627354621887f, factor * 0.41759559512138367f,
            factor * -0.19626937806606293f, factor * 0.04638524353504181f};
  }
  // factor log2(1 + 2^-|x2|) + add
  __device__ __forceinline__ float term(float x2, float add) const {
    const float t = fast_exp2(-fabsf(x2));
    return fmaf(t, fmaf(fmaf(fmaf(fmaf(c5, t, c4), t, c3), t, c2), t, c1), add);
  }
};

// The same polynomial on fp16 pairs (HFMA2: two terms an instruction), for the forward's fp16
// terms: the exponential of each in fp32 (one MUFU op), then t p(t) on the pair, the result
// already the pair the slot stores. Within 8.4e-5 of a score at scale 1 / sqrt(128) and 8.5e-4
// at scale 1 (numpy emulation with a rounding after each multiply and add; the fp32 form: 1.6e-5
// and 2.5e-4 with the fp16 store), for about 5 instructions a term instead of 7.5.
struct GateTermPairPoly {
  __half2 c1, c2, c3, c4, c5;
  static __device__ __forceinline__ GateTermPairPoly of(float factor) {
    const GateTermPoly p = GateTermPoly::of(factor);
    return {__float2half2_rn(p.c1), __float2half2_rn(p.c2), __float2half2_rn(p.c3), __float2half2_rn(p.c4),
            __float2half2_rn(p.c5)};
  }
  // factor log2(1 + 2^-|x|) of x0 and x1, as an fp16 pair in a 32-bit word (x0's in the low half)
  __device__ __forceinline__ uint32_t terms(float x0, float x1) const {
    const __half2 t = __floats2half2_rn(fast_exp2(-fabsf(x0)), fast_exp2(-fabsf(x1)));
    const __half2 r = __hmul2(__hfma2(__hfma2(__hfma2(__hfma2(c5, t, c4), t, c3), t, c2), t, c1), t);
    uint32_t w;
    memcpy(&w, &r, sizeof(w));
    return w;
  }
};

// A consumer thread's coordinates in the tile (the row/col view of its accumulator).
template <class Tiled, class IdentityTile>
__device__ __forceinline__ auto gate_thread_rowcol(const Tiled& mma, const IdentityTile& cS, int thread) {
  cute::Tensor t = mma.get_thread_slice(thread).partition_C(cS);
  return cute::make_tensor(t.data(), acc_rowcol(t.layout()));
}

// The alpha of a thread's two rows (coord: its row/col view), in log2 units.
template <class C>
__device__ __forceinline__ float2 gate_rows_alpha2(C const& coord, const float* s_alpha) {
  static_assert(decltype(cute::size<0>(coord))::value == 2, "two rows a thread");
  return {s_alpha[cute::get<0>(coord(0, 0))] * GateMath::kLog2e, s_alpha[cute::get<0>(coord(1, 0))] * GateMath::kLog2e};
}

// The ring: kSlots slots of one consumer's 64 rows of one key block each, in the order (block,
// consumer); the block count runs on across a CTA's tiles as the key-row pipeline's does.
template <int kBlockN, int kConsumers>
struct GateTermRing {
  static constexpr int kSlots = 3;                       // 48 KB at kBlockN = 128
  static constexpr int kChunks = kBlockN / 16;           // 16-byte chunks a consumer thread reads
  static constexpr int kSlotBytes = kChunks * 128 * 16;  // a consumer's 64 x kBlockN fp16 terms
  static constexpr int kBytes = kSlots * kSlotBytes;
  using Pipeline = cutlass::PipelineAsync<kSlots>;
  static constexpr int kProducerThreads = 64;  // warps 2 and 3

  // Consumer c's slot of the CTA's block-th key block.
  static __device__ __forceinline__ cutlass::PipelineState<kSlots> state(uint32_t block, int consumer, bool producer) {
    return pipeline_state_at<kSlots>(block * kConsumers + uint32_t(consumer), producer);
  }

  static __device__ __forceinline__ typename Pipeline::Params params(bool producer) {
    typename Pipeline::Params p;
    p.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    p.producer_arv_count = kProducerThreads;
    p.consumer_arv_count = 128;  // one consumer warpgroup reads a slot
    return p;
  }
};

// Producer thread p (0 .. 63) of warps 2 and 3 fills consumer `consumer`'s slot: the terms of
// consumer threads p and p + 64, from the stage's alpha (the tile's rows) and delta (the block's
// keys). mma_s: the consumers' tiled S product (the threads' coordinates), cS its identity tile.
template <class TiledMmaS, class IdentityTile>
__device__ __forceinline__ void fill_gate_terms(uint8_t* slot, const TiledMmaS& mma_s, const IdentityTile& cS,
                                                int consumer, int p, const float* s_alpha, const float* s_delta,
                                                const GateTermPairPoly& poly) {
  using namespace cute;
#pragma unroll 1
  for (int u = p; u < 128; u += 64) {
    const auto rc = gate_thread_rowcol(mma_s, cS, consumer * 128 + u);
    constexpr int kCols = decltype(size<1>(rc))::value;
    static_assert(kCols % 4 == 0);
    const float2 a = gate_rows_alpha2(rc, s_alpha);
    const float a0 = a.x, a1 = a.y;
    CUTE_UNROLL
    for (int k = 0; k < kCols / 4; ++k) {
      const float2 d0 = *reinterpret_cast<const float2*>(s_delta + get<1>(rc(0, 4 * k)));
      const float2 d1 = *reinterpret_cast<const float2*>(s_delta + get<1>(rc(0, 4 * k + 2)));
      uint4 w;
      w.x = poly.terms(a0 * d0.x, a0 * d0.y);
      w.y = poly.terms(a1 * d0.x, a1 * d0.y);
      w.z = poly.terms(a0 * d1.x, a0 * d1.y);
      w.w = poly.terms(a1 * d1.x, a1 * d1.y);
      *reinterpret_cast<uint4*>(slot + (k * 128 + u) * 16) = w;
    }
  }
}

// s += scale ln2 min(x2, cap) + term on the accumulator's row/col view (coord: (row, col) within
// the tile), the terms from consumer thread u's chunks of its slot (the layout above).
template <class S, class C>
__device__ __forceinline__ void add_gate_terms(S& s, C const& coord, const uint8_t* slot, int u, const float* s_alpha,
                                               const float* s_delta, float scale, bool linear) {
  using namespace cute;
  constexpr int kCols = decltype(size<1>(s))::value;
  const float cap = GateMath::of(linear).cap;
  const float scale_ln2 = scale * GateMath::kLn2;
  const float2 a = gate_rows_alpha2(coord, s_alpha);
  const float a0 = a.x, a1 = a.y;
  const uint4* chunks = reinterpret_cast<const uint4*>(slot) + u;
  auto add = [&](float& acc, float x2, float term) { acc = fmaf(scale_ln2, fminf(x2, cap), acc) + term; };
  CUTE_UNROLL
  for (int k = 0; k < kCols / 4; ++k) {
    const uint4 w = chunks[k * 128];
    const float2 d0 = *reinterpret_cast<const float2*>(s_delta + get<1>(coord(0, 4 * k)));
    const float2 d1 = *reinterpret_cast<const float2*>(s_delta + get<1>(coord(0, 4 * k + 2)));
    float t[8];
    ElemInfo<cutlass::half_t>::word_to_float2(w.x, t[0], t[1]);
    ElemInfo<cutlass::half_t>::word_to_float2(w.y, t[2], t[3]);
    ElemInfo<cutlass::half_t>::word_to_float2(w.z, t[4], t[5]);
    ElemInfo<cutlass::half_t>::word_to_float2(w.w, t[6], t[7]);
    add(s(0, 4 * k), a0 * d0.x, t[0]);
    add(s(0, 4 * k + 1), a0 * d0.y, t[1]);
    add(s(1, 4 * k), a1 * d0.x, t[2]);
    add(s(1, 4 * k + 1), a1 * d0.y, t[3]);
    add(s(0, 4 * k + 2), a0 * d1.x, t[4]);
    add(s(0, 4 * k + 3), a0 * d1.y, t[5]);
    add(s(1, 4 * k + 2), a1 * d1.x, t[6]);
    add(s(1, 4 * k + 3), a1 * d1.y, t[7]);
  }
}

// ---- the backward's form (bwd_ws_kernel_sm90.h: the gate alone and beside key rows) ----------
// Warp 3 of the producer warpgroup fills one slot a query block (64 queries x kBlockN keys) with
// its terms as bytes, q = round(255 k log2(1 + 2^-|x2|)), the term -q / 255 in log2 units: within
// 1/510 of it, 1.2e-4 of a score at scale 1 / sqrt(128), below P's own bf16 rounding there (2^-9
// relative). (At D = 128 the backward's shared memory has room for these 8 KB beside Q, dO, K, V,
// P, dS and dQ's staging, not for 16 KB of fp16 terms.) A NaN product's byte is 0: the consumers' minimum keeps the
// NaN instead (min.NaN). Layout: chunk k (16 bytes) of consumer thread u (0 .. 255) at (256 k + u)
// x 16; in chunk k the thread's columns 8k .. 8k + 7 as words of (r0: c, c+1; r1: c, c+1), c = 8k + 2j.
template <int kBlockM, int kBlockN>
struct GateTermBytes {
  static constexpr int kConsumerThreads = 256;
  static constexpr int kProducerThreads = 32;  // warp 3
  static constexpr int kBytes = kBlockM * kBlockN;
  static constexpr int kChunks = kBytes / kConsumerThreads / 16;
  static_assert(kChunks * kConsumerThreads * 16 == kBytes);
  using Pipeline = cutlass::PipelineAsync<1>;

  static __device__ __forceinline__ typename Pipeline::Params params(bool producer) {
    typename Pipeline::Params p;
    p.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    p.producer_arv_count = kProducerThreads;
    p.consumer_arv_count = kConsumerThreads;
    return p;
  }
};

// The low bytes of four words, packed (the first in the low byte).
__device__ __forceinline__ uint32_t gate_term_bytes(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  return __byte_perm(__byte_perm(w0, w1, 0x0040), __byte_perm(w2, w3, 0x0040), 0x5410);
}

// min(x, y) that returns NaN where either is NaN (fminf returns the other).
__device__ __forceinline__ float fmin_nan(float x, float y) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}

// Lane `lane` of warp 3 fills the slot: consumer threads lane + 32 i. mma_sdp: the consumers'
// tiled S product, cS its identity tile; alpha of the query block's rows, delta of the key block's.
template <class Tiled, class IdentityTile>
__device__ __forceinline__ void fill_gate_term_bytes(uint8_t* slot, const Tiled& mma_sdp, const IdentityTile& cS,
                                                     int lane, const float* s_alpha, const float* s_delta,
                                                     const GateTermPoly& poly) {
  using namespace cute;
  constexpr float kRound = 8388608.f;  // 2^23: q's rounding into the low bits of a float
#pragma unroll 1
  for (int u = lane; u < 256; u += 32) {
    const auto rc = gate_thread_rowcol(mma_sdp, cS, u);
    constexpr int kCols = decltype(size<1>(rc))::value;
    static_assert(kCols % 8 == 0);
    const float2 a = gate_rows_alpha2(rc, s_alpha);
    const float a0 = a.x, a1 = a.y;
    CUTE_UNROLL
    for (int k = 0; k < kCols / 8; ++k) {
      uint32_t w[4];
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const float2 d = *reinterpret_cast<const float2*>(s_delta + get<1>(rc(0, 8 * k + 2 * j)));
        w[j] = gate_term_bytes(__float_as_uint(poly.term(a0 * d.x, kRound)), __float_as_uint(poly.term(a0 * d.y, kRound)),
                               __float_as_uint(poly.term(a1 * d.x, kRound)), __float_as_uint(poly.term(a1 * d.y, kRound)));
      }
      *reinterpret_cast<uint4*>(slot + (k * 256 + u) * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// s += scale ln2 (min(x2, cap) - q / 255) on the accumulator's row/col view (coord as above), the
// bytes q from consumer thread u's chunks of the slot.
template <class S, class C>
__device__ __forceinline__ void add_gate_term_bytes(S& s, C const& coord, const uint8_t* slot, int u,
                                                    const float* s_alpha, const float* s_delta, float scale,
                                                    bool linear) {
  using namespace cute;
  constexpr int kCols = decltype(size<1>(s))::value;
  const float cap = GateMath::of(linear).cap;
  const float scale_ln2 = scale * GateMath::kLn2;
  const float per_q = -scale_ln2 / 255.f;
  const float2 a = gate_rows_alpha2(coord, s_alpha);
  const float a0 = a.x, a1 = a.y;
  const uint4* chunks = reinterpret_cast<const uint4*>(slot) + u;
  // byte i of w as a float (exact: 2^23 + i's low bits, minus 2^23)
  auto byte_of = [](uint32_t w, int i) { return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 + i)) - 8388608.f; };
  auto add = [&](float& acc, float x2, float q) { acc = fmaf(q, per_q, fmaf(scale_ln2, fmin_nan(x2, cap), acc)); };
  CUTE_UNROLL
  for (int k = 0; k < kCols / 8; ++k) {
    const uint4 v = chunks[k * 256];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int c = 8 * k + 2 * j;
      const float2 d = *reinterpret_cast<const float2*>(s_delta + get<1>(coord(0, c)));
      add(s(0, c), a0 * d.x, byte_of(w[j], 0));
      add(s(0, c + 1), a0 * d.y, byte_of(w[j], 1));
      add(s(1, c), a1 * d.x, byte_of(w[j], 2));
      add(s(1, c + 1), a1 * d.y, byte_of(w[j], 3));
    }
  }
}

}  // namespace dmattn::cuda::sm90
