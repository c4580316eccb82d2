// Indexed keys (KeyPositionsArgs::rows) for the kernels that read gathered rows only: the rows
// are gathered into a temporary (B, K, Hkv, D) copy of k and of v (stream-ordered allocation,
// freed on the stream after the kernels that read it), and the arguments point at the copy.
// The warp-specialized Hopper kernels read the rows in place and never need it.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/fwd_args.h"
#include "cuda/indexed/key_glue.h"
#include "cuda/common/stream_buffer.h"

namespace dmattn::cuda {

class GatheredRowsCopy {
 public:
  // Rewrites a's k, v (pointers and strides) to the copy and switches its indexed keys off.
  // (One allocation for both; a failed gather gives it back with the member's destructor.)
  GatheredRowsCopy(FwdArgs& a, int elem_bytes, cudaStream_t stream)
      : copy_(2 * operand_bytes(a, elem_bytes) + 16, stream, "cudaMallocAsync(gathered key rows)") {
    const int heads_kv = a.num_heads / a.group;
    const int64_t row_elems = int64_t(heads_kv) * a.head_dim;
    const size_t bytes = operand_bytes(a, elem_bytes);
    GatherRowsArgs g;
    const void* src[2] = {a.k, a.v};
    const int64_t sb[2] = {a.k_bs, a.v_bs}, sr[2] = {a.k_rs, a.v_rs}, sh[2] = {a.k_hs, a.v_hs};
    char* dst[2] = {static_cast<char*>(copy_.get()), static_cast<char*>(copy_.get()) + bytes};
    for (int i = 0; i < 2; ++i) g.operand[i] = {src[i], sb[i], sr[i], sh[i], dst[i]};
    g.positions = a.kpos.rows;
    g.pos_batch = a.kpos.stride_b == 0 ? 1 : a.batch;
    g.pos_heads = a.kpos.stride_h == 0 ? 1 : heads_kv;
    g.pos_sb = a.kpos.stride_b;
    g.pos_sh = a.kpos.stride_h;
    g.batch = a.batch, g.width = a.seqlen_k, g.heads = heads_kv;
    g.row_bytes = int64_t(a.head_dim) * elem_bytes;
    g.elem_bytes = elem_bytes;
    g.src_batch_div = a.kpos.rows_batch_div;
    g.src_rows = a.kpos.rows_source_len;
    // (16-byte chunks: the backend checked k and v for 16-byte aligned pointers and strides of
    // multiples of 8 elements, check_seq_tensor, and head_dim is a multiple of 8)
    gather_rows(g, /*vec16=*/true, stream);
    a.k = dst[0], a.v = dst[1];
    a.k_rs = a.v_rs = row_elems, a.k_hs = a.v_hs = a.head_dim, a.k_bs = a.v_bs = a.seqlen_k * row_elems;
    a.kpos.rows = nullptr;
  }

 private:
  // One operand's (B, K, Hkv, D) copy: a multiple of 16 bytes (head_dim % 8 == 0).
  static size_t operand_bytes(const FwdArgs& a, int elem_bytes) {
    return size_t(a.batch) * a.seqlen_k * (a.num_heads / a.group) * a.head_dim * elem_bytes;
  }
  StreamBuffer copy_;
};

}  // namespace dmattn::cuda
