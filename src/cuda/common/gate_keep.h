// Gate skipping's cells on CUDA (docs/semantics.md, "Gate skipping"; the rule as
// python/dmattn/gate_skip.py writes it): one launch from alpha and delta to the bool map
// keep (B, H, cells of max_seqlen_q, cells of max_seqlen_k), so that a training step pays one
// small kernel rather than a few dozen framework ops of host time.
#pragma once

#include <cstdint>

namespace dmattn::cuda {

struct GateKeepArgs {
  const void* alpha = nullptr;  // (B, Sq, H) / packed (total_q, H): element (b, i, h) at b*a_bs + i*a_rs + h*a_hs
  const void* delta = nullptr;  // (B, Sk, Hkv) / packed (total_k, Hkv)
  int64_t a_bs = 0, a_rs = 0, a_hs = 0, d_bs = 0, d_rs = 0, d_hs = 0;
  int alpha_type = 0, delta_type = 0;  // 0 float32, 1 float16, 2 bfloat16
  const int32_t* cu_seqlens_q = nullptr;  // packed batches (both or neither), else every
  const int32_t* cu_seqlens_k = nullptr;  // sequence has seqlen_q / seqlen_k rows
  int batch = 0, heads = 0, group = 1, seqlen_q = 0, seqlen_k = 0;
  int m_cells = 0, n_cells = 0;  // the map's cells per (b, h): ceil(seqlen / 128) of the (max) lengths
  float scale = 1.f, log_threshold = 0.f, threshold = 0.f;
  bool logsigmoid = true, causal = false, adaptive = false;
  int window_left = -1, window_right = -1;
  uint8_t* keep = nullptr;  // contiguous (B, H, m_cells, n_cells)
};

// The shared memory the launch takes (4 floats per query and per key cell): callers with more
// cells than a block's shared memory holds use the framework path.
int64_t gate_keep_smem_bytes(int m_cells, int n_cells);

void launch_gate_keep(const GateKeepArgs& a, void* stream);

}  // namespace dmattn::cuda
