// Validation of the decode path's key-side inputs (per-batch lengths, paged or gathered keys,
// split-KV workspace) on top of make_forward_params, and the decode_splits query.
#include <vector>

#include "api/tensor_checks.h"
#include "dmattn/api.h"
#ifdef DMATTN_WITH_CUDA
#include "cuda/host/decode_backend.h"
#endif

namespace dmattn {
namespace {

using namespace checks;  // NOLINT: the shared argument checks

// A (B, Sk, Hkv, D) view of a paged cache (num_blocks, page_size, Hkv, D) for the dense
// validation: stride 0 along the batch (each batch's pages come from block_table).
TensorDesc paged_view(const TensorDesc& cache, int64_t batch, int64_t max_blocks) {
  TensorDesc view = cache;
  view.shape = {batch, max_blocks * cache.shape[1], cache.shape[2], cache.shape[3]};
  view.strides = {0, cache.strides[1], cache.strides[2], cache.strides[3]};
  return view;
}

// The key / value tensors' own rules under the caller's names, before the dense validation
// (which names them k and v): rank, one shape, q's device and dtype, q's head_dim, kv heads
// dividing q's heads, and (a contiguous cache) q's batch.
void check_key_pair(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v, const char* k_name,
                    const char* v_name, bool paged) {
  const char* layout =
      paged ? "(num_blocks, page_size, num_heads_kv, head_dim)" : "(batch, seqlen_k, num_heads_kv, head_dim)";
  check_rank(k, 4, k_name, layout);
  check(k.shape == v.shape, ErrorKind::kValue, v_name, ": expected the shape of ", k_name, " ", k.shape_text(),
        ", got ", v.shape_text());
  check_same_device(q, k, k_name);
  check_same_device(q, v, v_name);
  check_dtype(k, q.dtype, k_name);
  check_dtype(v, q.dtype, v_name);
  check(k.shape[3] == q.shape[3], ErrorKind::kValue, k_name, ": expected head_dim ", q.shape[3],
        " like q, got shape ", k.shape_text());
  check(k.shape[2] >= 1 && q.shape[2] % k.shape[2] == 0, ErrorKind::kValue, k_name, ": num_heads_kv (",
        k.shape[2], ") must be >= 1 and divide num_heads (", q.shape[2], ")");
  if (paged) {
    check(k.shape[1] >= 1, ErrorKind::kValue, k_name, ": expected a page size >= 1, got shape ", k.shape_text());
  } else {
    check(k.shape[0] == q.shape[0], ErrorKind::kValue, k_name, ": expected batch ", q.shape[0],
          " like q, got shape ", k.shape_text());
  }
}

// The decode kernel's indexed keys (DecodeInputs::gathered): rows read in place (key_rows the
// positions themselves; before make_forward_params, which reads key_positions without key_rows as
// gathered copies), then, on its params, one key set per kv head and only calls whose rules the
// positions cannot change (the kernel tests the gathered index).
void check_gathered_inputs(const GatheredKeys& gathered) {
  check(gathered.key_rows != nullptr && gathered.key_rows->data == gathered.key_positions->data, ErrorKind::kValue,
        "key_rows: the decode kernel reads gathered keys in place: expected key_rows to be key_positions");
  check(gathered.key_ends == nullptr, ErrorKind::kNotImplemented,
        "key_ends: per-query key bounds are not read by the decode kernel");
}

void check_gathered_params(const TensorDesc& positions, const ForwardParams& p) {
  check(positions.shape[1] == 1 || positions.shape[1] == p.num_heads_kv, ErrorKind::kValue,
        "key_positions: the decode kernel takes one key set per kv head: expected shape (1 or ", p.batch,
        ", 1 or ", p.num_heads_kv, ", K), got ", positions.shape_text());
  check(p.window_left < 0 && (p.window_right < 0 || p.seqlen_q == 1), ErrorKind::kNotImplemented,
        "window: with gathered keys the decode kernel takes no left window, and causal or a right window ",
        "only for one query (which sees every earlier key); got window (", p.window_left, ", ", p.window_right,
        ") with seqlen_q ", p.seqlen_q);
}

// The decode fields of p, last (after every other argument is checked, on any device: the C++
// tests run on the CPU): the float32 workspace that num_splits > 1 splits of `rows` query rows
// (B * H * Sq, or H * total_q packed) need (one passed with one split is kept for the balanced
// form), then CUDA only.
void set_decode_splits(const TensorDesc& q, const TensorDesc* workspace, int64_t num_splits, int64_t rows,
                       ForwardParams& p) {
  check(num_splits == 1 || workspace != nullptr, ErrorKind::kValue, "workspace: ", num_splits,
        " key splits need a float32 workspace, got none");
  if (workspace != nullptr) {
    const TensorDesc& w = *workspace;
    check_same_device(q, w, "workspace");
    check_dtype(w, DType::kFloat32, "workspace");
    check_contiguous(w, "workspace");
    const int64_t need = num_splits > 1 ? num_splits * rows * (p.head_dim + 1) : 0;
    check(w.numel() >= need, ErrorKind::kValue, "workspace: expected at least ", need,
          " float32 elements, got ", w.numel());
    p.split_workspace = static_cast<float*>(w.data);
    p.split_workspace_floats = w.numel();
  }
  check(q.device == DeviceKind::kCUDA, ErrorKind::kNotImplemented,
        "q: the decode kernel runs on CUDA tensors; got a tensor on ", device_name(q.device));
  p.decode_splits = num_splits;
}

}  // namespace

int64_t decode_splits(DeviceKind device, int32_t device_id, int64_t batch, int64_t seqlen_q, int64_t num_heads,
                      int64_t num_heads_kv, int64_t head_dim, int64_t seqlen_k, int64_t max_rows) {
  if (device != DeviceKind::kCUDA || num_heads_kv < 1 || num_heads % num_heads_kv != 0) return 0;
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0 || seqlen_q < 1) return 0;
  const int64_t group = num_heads / num_heads_kv;
  if (seqlen_q * group > max_rows) return 0;
#ifdef DMATTN_WITH_CUDA
  const int64_t ctas = batch * num_heads_kv * cuda::decode_row_chunks(seqlen_q, group, head_dim);
  return cuda::decode_num_splits(ctas, seqlen_k, device_id);
#else
  (void)batch, (void)seqlen_k, (void)device_id;
  return 0;
#endif
}

int64_t decode_packed_splits(DeviceKind device, int32_t device_id, int64_t num_heads, int64_t num_heads_kv,
                             int64_t head_dim, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  if (device != DeviceKind::kCUDA || num_heads_kv < 1 || num_heads % num_heads_kv != 0) return 0;
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0 || max_seqlen_q < 1) return 0;
#ifdef DMATTN_WITH_CUDA
  return cuda::decode_packed_splits(num_heads_kv, num_heads / num_heads_kv, head_dim, max_seqlen_q, max_seqlen_k,
                                    device_id);
#else
  (void)device_id, (void)max_seqlen_k;
  return 0;
#endif
}

int64_t decode_balanced_splits(DeviceKind device, int32_t device_id, int64_t batch, int64_t seqlen_q,
                               int64_t num_heads, int64_t num_heads_kv, int64_t head_dim, int64_t seqlen_k) {
  if (device != DeviceKind::kCUDA || num_heads_kv < 1 || num_heads % num_heads_kv != 0) return 0;
#ifdef DMATTN_WITH_CUDA
  return cuda::decode_balanced_splits(batch, seqlen_q, num_heads / num_heads_kv, num_heads_kv, head_dim, seqlen_k,
                                      device_id);
#else
  (void)device_id, (void)batch, (void)seqlen_q, (void)head_dim, (void)seqlen_k;
  return 0;
#endif
}

ForwardParams make_varlen_decode_forward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                                const VarlenPacking& packing, const TensorDesc& out,
                                                const TensorDesc& lse, const TensorDesc* mask, const TensorDesc* bias,
                                                const AttentionOptions& options, const TensorDesc* workspace,
                                                int64_t num_splits) {
  ForwardParams p = make_varlen_forward_params(q, k, v, packing, out, lse, mask, bias, options);
  check(num_splits >= 1, ErrorKind::kValue, "num_splits: expected >= 1, got ", num_splits);
  set_decode_splits(q, workspace, num_splits, p.num_heads * p.total_q, p);
  return p;
}

ForwardParams make_decode_forward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                         const TensorDesc& out, const TensorDesc& lse, const TensorDesc* mask,
                                         const TensorDesc* bias, const AttentionOptions& options,
                                         const DecodeInputs& inputs) {
  check_rank(q, 4, "q", "(batch, seqlen_q, num_heads, head_dim)");
  const int64_t batch = q.shape[0];
  check(inputs.num_splits >= 1, ErrorKind::kValue, "num_splits: expected >= 1, got ", inputs.num_splits);

  ForwardParams p;
  check(inputs.block_table == nullptr || inputs.gathered.key_positions == nullptr, ErrorKind::kValue,
        "key_positions: the decode kernel reads gathered keys from a contiguous k, v, not with block_table");
  if (inputs.block_table != nullptr) {
    const TensorDesc& bt = *inputs.block_table;
    check_rank(bt, 2, "block_table", "(batch, max_blocks)");
    check_same_device(q, bt, "block_table");
    check_dtype(bt, DType::kInt32, "block_table");
    check(bt.shape[0] == batch, ErrorKind::kValue, "block_table: expected ", batch, " rows (q's batch), got shape ",
          bt.shape_text());
    check(bt.shape[1] <= 1 || bt.strides[1] == 1, ErrorKind::kValue,
          "block_table: expected a unit stride along the blocks, got strides (", bt.strides[0], ", ", bt.strides[1],
          ")");
    check_key_pair(q, k, v, "k_cache", "v_cache", true);
    const int64_t max_blocks = bt.shape[1];
    p = make_forward_params(q, paged_view(k, batch, max_blocks), paged_view(v, batch, max_blocks), out, lse, mask,
                            bias, options);
    p.k_strides.batch_stride = k.strides[0];
    p.v_strides.batch_stride = v.strides[0];
    p.block_table = static_cast<const int32_t*>(bt.data);
    p.block_table_stride = bt.strides[0];
    p.page_size = k.shape[1];
  } else {
    check_key_pair(q, k, v, inputs.k_name, inputs.v_name, false);
    const bool gathered = inputs.gathered.key_positions != nullptr;
    if (gathered) check_gathered_inputs(inputs.gathered);
    p = make_forward_params(q, k, v, out, lse, mask, bias, options, inputs.gathered);
    if (gathered) check_gathered_params(*inputs.gathered.key_positions, p);
  }
  if (inputs.seqused_k != nullptr) {
    const TensorDesc& s = *inputs.seqused_k;
    check_same_device(q, s, "cache_seqlens");
    check_dtype(s, DType::kInt32, "cache_seqlens");
    check_shape(s, {batch}, "cache_seqlens");
    check_contiguous(s, "cache_seqlens");
    p.seqused_k = static_cast<const int32_t*>(s.data);
  }
  set_decode_splits(q, inputs.workspace, inputs.num_splits, batch * p.num_heads * p.seqlen_q, p);
  p.decode_balanced = inputs.balanced && inputs.gathered.key_positions == nullptr;
  return p;
}

}  // namespace dmattn
