// tvm-ffi binding: the library's only framework-facing file.
//
// Functions take DLPack tensors (torch, numpy, JAX, CuPy...) in destination-passing style:
// the caller allocates every output and scratch buffer, so the Python layer stays in charge
// of memory (caching allocator, CUDA graphs) and the C++ core never allocates device memory.
// The exceptions, decode_attention (a decoding step), topk_attention (attention_topk's forward)
// and topk_attention_backward, calls where host time counts, allocate through the caller's
// framework (tvm-ffi's environment allocator), never by themselves.
// dmattn::Error is re-raised with its kind (ValueError / TypeError / RuntimeError) and its
// message intact.
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>

#include "decode_scratch.h"
#include "dmattn/api.h"

namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

dmattn::DType to_dtype(DLDataType t) {
  if (t.lanes != 1) return dmattn::DType::kOther;
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 32) return dmattn::DType::kFloat32;
      if (t.bits == 16) return dmattn::DType::kFloat16;
      if (t.bits == 64) return dmattn::DType::kFloat64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return dmattn::DType::kBFloat16;
      break;
    case kDLBool:
      if (t.bits == 8) return dmattn::DType::kBool;
      break;
    case kDLInt:
      if (t.bits == 32) return dmattn::DType::kInt32;
      if (t.bits == 64) return dmattn::DType::kInt64;
      break;
    default:
      break;
  }
  return dmattn::DType::kOther;
}

dmattn::TensorDesc to_desc(const TensorView& view) {
  dmattn::TensorDesc d;
  d.dtype = to_dtype(view.dtype());
  d.data = static_cast<char*>(view.data_ptr()) + view.byte_offset();
  const DLDevice device = view.device();
  d.device = device.device_type == kDLCPU    ? dmattn::DeviceKind::kCPU
             : device.device_type == kDLCUDA ? dmattn::DeviceKind::kCUDA
                                             : dmattn::DeviceKind::kOther;
  d.device_id = device.device_id;
  // tvm-ffi fills strides when it imports a DLPack tensor, compact ones included.
  const auto shape = view.shape();
  const auto strides = view.strides();
  d.shape.assign(shape.begin(), shape.end());
  d.strides.assign(strides.begin(), strides.end());
  return d;
}

struct OptionalDesc {
  dmattn::TensorDesc desc;
  bool present = false;
  explicit OptionalDesc(const Optional<TensorView>& t) {
    if (t.has_value()) desc = to_desc(t.value()), present = true;
  }
  const dmattn::TensorDesc* get() const { return present ? &desc : nullptr; }
};

dmattn::AttentionOptions make_options(bool causal, int64_t window_left, int64_t window_right,
                                      double scale, double softcap, bool deterministic) {
  dmattn::AttentionOptions o;
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.scale = scale;  // NaN = default 1/sqrt(D)
  o.softcap = softcap;
  o.deterministic = deterministic;
  return o;
}

// key_positions absent: k, v hold every key (seqlen_k_original is then ignored). key_ends:
// optional per-row query bound of the gathered rows.
// key_rows: optional, indexed keys (k, v are then the source rows).
struct GatheredKeysArg {
  OptionalDesc positions, ends, rows;
  int64_t seqlen_k_original;
  GatheredKeysArg(const Optional<TensorView>& key_positions, int64_t original, const Optional<TensorView>& key_ends,
                  const Optional<TensorView>& key_rows)
      : positions(key_positions), ends(key_ends), rows(key_rows), seqlen_k_original(original) {}
  dmattn::GatheredKeys get() const { return {positions.get(), seqlen_k_original, ends.get(), rows.get()}; }
};

// The gate (alpha, delta, gate_fn: 0 logsigmoid, 1 linear) and windows with sinks: optional.
// gate_keep: gate skipping's cells (optional).
struct ScoreTermsArg {
  OptionalDesc alpha, delta, windows, gate_keep;
  int64_t gate_fn;
  ScoreTermsArg(const Optional<TensorView>& a, const Optional<TensorView>& d, int64_t fn,
                const Optional<TensorView>& w, const Optional<TensorView>& keep)
      : alpha(a), delta(d), windows(w), gate_keep(keep), gate_fn(fn) {}
  dmattn::ScoreTerms get() const {
    return {alpha.get(), delta.get(), static_cast<dmattn::GateFn>(gate_fn), windows.get(), gate_keep.get()};
  }
};

void* current_stream(const dmattn::ForwardParams& p) {
  if (p.device != dmattn::DeviceKind::kCUDA) return nullptr;
  return TVMFFIEnvGetStream(kDLCUDA, p.device_id);
}

// Runs `body`, translating dmattn::Error into a tvm-ffi error of the same Python kind.
template <typename Body>
void translate_errors(Body&& body) {
  try {
    body();
  } catch (const dmattn::Error& e) {
    throw tvm::ffi::Error(e.python_kind(), e.what(), "");
  }
}

void forward(TensorView q, TensorView k, TensorView v, TensorView out, TensorView lse,
             Optional<TensorView> mask, Optional<TensorView> bias, bool causal,
             int64_t window_left, int64_t window_right, double scale, double softcap,
             Optional<TensorView> key_positions, int64_t seqlen_k_original, Optional<TensorView> key_ends,
             Optional<TensorView> key_rows, Optional<TensorView> alpha, Optional<TensorView> delta,
             int64_t gate_fn, Optional<TensorView> windows, Optional<TensorView> gate_keep) {
  translate_errors([&] {
    const OptionalDesc mask_d(mask), bias_d(bias);
    const GatheredKeysArg gathered(key_positions, seqlen_k_original, key_ends, key_rows);
    const ScoreTermsArg terms(alpha, delta, gate_fn, windows, gate_keep);
    dmattn::ForwardParams p = dmattn::make_forward_params(
        to_desc(q), to_desc(k), to_desc(v), to_desc(out), to_desc(lse), mask_d.get(),
        bias_d.get(), make_options(causal, window_left, window_right, scale, softcap, false),
        gathered.get());
    dmattn::set_score_terms(terms.get(), p);
    p.stream = current_stream(p);
    dmattn::run_forward(p);
  });
}

void backward(TensorView q, TensorView k, TensorView v, TensorView out, TensorView lse,
              Optional<TensorView> mask, Optional<TensorView> bias, TensorView dout,
              TensorView dq, TensorView dk, TensorView dv, Optional<TensorView> dbias,
              Optional<TensorView> softmax_delta, Optional<TensorView> dq_accum,
              Optional<TensorView> dbias_accum, bool causal, int64_t window_left,
              int64_t window_right, double scale, double softcap, bool deterministic,
              Optional<TensorView> key_positions, int64_t seqlen_k_original, Optional<TensorView> key_ends,
              bool forward_stats, Optional<TensorView> key_rows, Optional<TensorView> alpha,
              Optional<TensorView> delta, int64_t gate_fn, Optional<TensorView> windows,
              Optional<TensorView> dalpha, Optional<TensorView> ddelta, Optional<TensorView> dalpha_accum,
              Optional<TensorView> gate_keep) {
  translate_errors([&] {
    const OptionalDesc mask_d(mask), bias_d(bias), dbias_d(dbias), delta_d(softmax_delta),
        dq_accum_d(dq_accum), dbias_accum_d(dbias_accum), dalpha_d(dalpha), ddelta_d(ddelta),
        dalpha_accum_d(dalpha_accum);
    const GatheredKeysArg gathered(key_positions, seqlen_k_original, key_ends, key_rows);
    const ScoreTermsArg terms(alpha, delta, gate_fn, windows, gate_keep);
    dmattn::BackwardParams p = dmattn::make_backward_params(
        to_desc(q), to_desc(k), to_desc(v), to_desc(out), to_desc(lse), mask_d.get(),
        bias_d.get(), to_desc(dout), to_desc(dq), to_desc(dk), to_desc(dv), dbias_d.get(),
        delta_d.get(), dq_accum_d.get(), dbias_accum_d.get(),
        make_options(causal, window_left, window_right, scale, softcap, deterministic),
        gathered.get());
    dmattn::set_score_terms(terms.get(), dalpha_d.get(), ddelta_d.get(), dalpha_accum_d.get(), p);
    p.forward_stats = forward_stats;
    p.fwd.stream = current_stream(p.fwd);
    dmattn::run_backward(p);
  });
}

// ---- Packed variable-length batches: q (total_q, H, D), k/v (total_k, Hkv, D), lse
// (H, total_q), int32 cu_seqlens of length B + 1, key-side mask/bias (Hb, total_k).

dmattn::VarlenPacking make_packing(const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                   int64_t max_seqlen_q, int64_t max_seqlen_k) {
  dmattn::VarlenPacking packing;
  packing.cu_seqlens_q = to_desc(cu_seqlens_q);
  packing.cu_seqlens_k = to_desc(cu_seqlens_k);
  packing.max_seqlen_q = max_seqlen_q;
  packing.max_seqlen_k = max_seqlen_k;
  return packing;
}

void forward_varlen(TensorView q, TensorView k, TensorView v, TensorView cu_seqlens_q,
                    TensorView cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                    TensorView out, TensorView lse, Optional<TensorView> mask,
                    Optional<TensorView> bias, bool causal, int64_t window_left,
                    int64_t window_right, double scale, double softcap, Optional<TensorView> alpha,
                    Optional<TensorView> delta, int64_t gate_fn, Optional<TensorView> windows,
                    Optional<TensorView> gate_keep) {
  translate_errors([&] {
    const OptionalDesc mask_d(mask), bias_d(bias);
    const ScoreTermsArg terms(alpha, delta, gate_fn, windows, gate_keep);
    dmattn::ForwardParams p = dmattn::make_varlen_forward_params(
        to_desc(q), to_desc(k), to_desc(v),
        make_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), to_desc(out),
        to_desc(lse), mask_d.get(), bias_d.get(),
        make_options(causal, window_left, window_right, scale, softcap, false));
    dmattn::set_score_terms(terms.get(), p);
    p.stream = current_stream(p);
    dmattn::run_forward(p);
  });
}

void backward_varlen(TensorView q, TensorView k, TensorView v, TensorView cu_seqlens_q,
                     TensorView cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                     TensorView out, TensorView lse, Optional<TensorView> mask,
                     Optional<TensorView> bias, TensorView dout, TensorView dq, TensorView dk,
                     TensorView dv, Optional<TensorView> dbias, Optional<TensorView> softmax_delta,
                     Optional<TensorView> dq_accum, Optional<TensorView> dbias_accum, bool causal,
                     int64_t window_left, int64_t window_right, double scale, double softcap,
                     bool deterministic, Optional<TensorView> alpha, Optional<TensorView> delta,
                     int64_t gate_fn, Optional<TensorView> windows, Optional<TensorView> dalpha,
                     Optional<TensorView> ddelta, Optional<TensorView> dalpha_accum,
                     Optional<TensorView> gate_keep) {
  translate_errors([&] {
    const OptionalDesc mask_d(mask), bias_d(bias), dbias_d(dbias), delta_d(softmax_delta),
        dq_accum_d(dq_accum), dbias_accum_d(dbias_accum), dalpha_d(dalpha), ddelta_d(ddelta),
        dalpha_accum_d(dalpha_accum);
    const ScoreTermsArg terms(alpha, delta, gate_fn, windows, gate_keep);
    dmattn::BackwardParams p = dmattn::make_varlen_backward_params(
        to_desc(q), to_desc(k), to_desc(v),
        make_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), to_desc(out),
        to_desc(lse), mask_d.get(), bias_d.get(), to_desc(dout), to_desc(dq), to_desc(dk),
        to_desc(dv), dbias_d.get(), delta_d.get(), dq_accum_d.get(), dbias_accum_d.get(),
        make_options(causal, window_left, window_right, scale, softcap, deterministic));
    dmattn::set_score_terms(terms.get(), dalpha_d.get(), ddelta_d.get(), dalpha_accum_d.get(), p);
    p.fwd.stream = current_stream(p.fwd);
    dmattn::run_backward(p);
  });
}

// The value checks of host copies of cu_seqlens (the Python ops call it for CUDA tensors,
// whose values the core cannot read without a device synchronization).
void check_cu_seqlens(TensorView cu_seqlens_q, TensorView cu_seqlens_k, int64_t max_seqlen_q,
                      int64_t max_seqlen_k, int64_t total_q, int64_t total_k) {
  translate_errors([&] {
    dmattn::check_cu_seqlens_values(
        make_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), total_q, total_k);
  });
}

// The caller's current stream on `device` (tvm-ffi's environment: torch's current stream), or
// null off CUDA.
void* device_stream(DLDevice device) {
  return device.device_type == kDLCUDA ? TVMFFIEnvGetStream(kDLCUDA, device.device_id) : nullptr;
}

// The gather path's glue (dmattn/api.h): the top-k key positions of a key-side bias, and the
// K / V / bias rows at them. CUDA tensors, on the current stream.
void* glue_stream(const TensorView& t) { return device_stream(t.device()); }

// Gate skipping's cells on CUDA (dmattn::gate_keep_cells): false where the framework path must
// compute them (too many cells for the kernel).
bool gate_keep_cells(TensorView alpha, TensorView delta, Optional<TensorView> cu_seqlens_q,
                     Optional<TensorView> cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                     int64_t gate_fn, double threshold, bool causal, bool adaptive, int64_t window_left,
                     int64_t window_right, TensorView keep) {
  bool done = false;
  translate_errors([&] {
    const OptionalDesc cu_q(cu_seqlens_q), cu_k(cu_seqlens_k);
    dmattn::GateKeepOptions options;
    options.scale = scale, options.threshold = threshold, options.gate_fn = static_cast<dmattn::GateFn>(gate_fn);
    options.causal = causal, options.adaptive = adaptive;
    options.window_left = window_left, options.window_right = window_right;
    done = dmattn::gate_keep_cells(to_desc(alpha), to_desc(delta), cu_q.get(), cu_k.get(), max_seqlen_q, max_seqlen_k,
                                   options, to_desc(keep), glue_stream(alpha));
  });
  return done;
}

void select_topk_positions(TensorView bias, int64_t keep, TensorView positions, Optional<TensorView> values) {
  translate_errors([&] {
    const OptionalDesc values_d(values);
    dmattn::select_topk_positions(to_desc(bias), keep, to_desc(positions), values_d.get(), glue_stream(bias));
  });
}

void gather_key_rows(TensorView k, TensorView v, TensorView positions, TensorView k_rows, TensorView v_rows,
                     Optional<TensorView> bias, Optional<TensorView> bias_rows) {
  translate_errors([&] {
    const OptionalDesc bias_d(bias), bias_rows_d(bias_rows);
    dmattn::gather_key_rows(to_desc(k), to_desc(v), to_desc(positions), to_desc(k_rows), to_desc(v_rows),
                            bias_d.get(), bias_rows_d.get(), glue_stream(k));
  });
}

void scatter_key_rows(TensorView dk_rows, TensorView dv_rows, TensorView positions, TensorView dk, TensorView dv,
                      Optional<TensorView> dbias_rows, Optional<TensorView> dbias) {
  translate_errors([&] {
    const OptionalDesc dbias_rows_d(dbias_rows), dbias_d(dbias);
    dmattn::scatter_key_rows(to_desc(dk_rows), to_desc(dv_rows), to_desc(positions), to_desc(dk), to_desc(dv),
                             dbias_rows_d.get(), dbias_d.get(), glue_stream(dk_rows));
  });
}

// Per-query causal top-k glue (dmattn/api.h), CPU or CUDA tensors.
void prefix_thresholds(TensorView ranks, TensorView order, int64_t keep, TensorView thresholds) {
  translate_errors([&] {
    dmattn::prefix_thresholds(to_desc(ranks), to_desc(order), keep, to_desc(thresholds), glue_stream(ranks));
  });
}

void selection_key(TensorView scores, Optional<TensorView> allowed, TensorView key) {
  translate_errors([&] {
    const OptionalDesc allowed_d(allowed);
    dmattn::selection_key(to_desc(scores), allowed_d.get(), to_desc(key), glue_stream(scores));
  });
}

void interval_ends(TensorView sorted, Optional<TensorView> allowed, int64_t keep, TensorView ranks, TensorView order,
                   TensorView thresholds, TensorView ends) {
  translate_errors([&] {
    const OptionalDesc allowed_d(allowed);
    dmattn::interval_ends(to_desc(sorted), allowed_d.get(), keep, to_desc(ranks), to_desc(order), to_desc(thresholds),
                          to_desc(ends), glue_stream(sorted));
  });
}

void segment_candidates(TensorView ends, int64_t offset, int64_t seg_len, TensorView positions, TensorView key_ends,
                        TensorView index, TensorView slots) {
  translate_errors([&] {
    dmattn::segment_candidates(to_desc(ends), offset, seg_len, to_desc(positions), to_desc(key_ends), to_desc(index),
                               to_desc(slots), glue_stream(ends));
  });
}

void gather_segment_rows(TensorView k, TensorView v, TensorView index, TensorView k_rows, TensorView v_rows) {
  translate_errors([&] {
    dmattn::gather_segment_rows(to_desc(k), to_desc(v), to_desc(index), to_desc(k_rows), to_desc(v_rows),
                                glue_stream(k));
  });
}

void sum_segment_rows(TensorView dk_rows, TensorView dv_rows, TensorView slots, TensorView dk, TensorView dv) {
  translate_errors([&] {
    dmattn::sum_segment_rows(to_desc(dk_rows), to_desc(dv_rows), to_desc(slots), to_desc(dk), to_desc(dv),
                             glue_stream(dk_rows));
  });
}

// The decode path (docs/decode.md): forward_decode runs the split-KV kernel with num_splits
// splits (decode_splits' answer for these shapes); cache_seqlens / block_table / workspace are
// optional (dmattn/api.h, DecodeInputs), and so is key_positions: indexed keys (k, v the source
// rows, key j of (b, kv head) their row key_positions[b', h', j]; DecodeInputs::gathered).
// The key side of both decode calls but the workspace.
dmattn::DecodeInputs decode_inputs(const OptionalDesc& seqlens, const OptionalDesc& table,
                                   const OptionalDesc& key_positions, const dmattn::TensorDesc& k,
                                   int64_t num_splits) {
  dmattn::DecodeInputs inputs;
  inputs.seqused_k = seqlens.get();
  inputs.block_table = table.get();
  if (key_positions.present) {
    inputs.gathered.key_positions = inputs.gathered.key_rows = key_positions.get();
    inputs.gathered.seqlen_k_original = k.shape.size() == 4 ? k.shape[1] : 0;
  }
  inputs.num_splits = num_splits;
  return inputs;
}

void forward_decode(TensorView q, TensorView k, TensorView v, TensorView out, TensorView lse,
                    Optional<TensorView> mask, Optional<TensorView> bias, bool causal, int64_t window_left,
                    int64_t window_right, double scale, double softcap, Optional<TensorView> cache_seqlens,
                    Optional<TensorView> block_table, Optional<TensorView> workspace, int64_t num_splits,
                    Optional<TensorView> key_positions) {
  translate_errors([&] {
    const OptionalDesc mask_d(mask), bias_d(bias), seqlens_d(cache_seqlens), table_d(block_table),
        workspace_d(workspace), positions_d(key_positions);
    const dmattn::TensorDesc k_d = to_desc(k);
    dmattn::DecodeInputs inputs = decode_inputs(seqlens_d, table_d, positions_d, k_d, num_splits);
    inputs.workspace = workspace_d.get();
    dmattn::ForwardParams p = dmattn::make_decode_forward_params(
        to_desc(q), k_d, to_desc(v), to_desc(out), to_desc(lse), mask_d.get(), bias_d.get(),
        make_options(causal, window_left, window_right, scale, softcap, false), inputs);
    p.stream = current_stream(p);
    dmattn::run_forward(p);
  });
}

// A packed batch's sequences of at most 64 query rows on the decode kernels (num_splits:
// decode_packed_splits' answer), writing their rows of out and lse; the other rows are left as
// they are (forward_varlen, called first, computes them).
void forward_varlen_decode(TensorView q, TensorView k, TensorView v, TensorView cu_seqlens_q,
                           TensorView cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, TensorView out,
                           TensorView lse, Optional<TensorView> mask, Optional<TensorView> bias, bool causal,
                           int64_t window_left, int64_t window_right, double scale, double softcap,
                           Optional<TensorView> workspace, int64_t num_splits) {
  translate_errors([&] {
    const OptionalDesc mask_d(mask), bias_d(bias), workspace_d(workspace);
    dmattn::ForwardParams p = dmattn::make_varlen_decode_forward_params(
        to_desc(q), to_desc(k), to_desc(v), make_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        to_desc(out), to_desc(lse), mask_d.get(), bias_d.get(),
        make_options(causal, window_left, window_right, scale, softcap, false), workspace_d.get(), num_splits);
    p.stream = current_stream(p);
    dmattn::run_forward(p);
  });
}

// The calls that allocate (decode_attention, topk_attention) do it through tvm-ffi's environment
// allocator, which a call with framework tensors sets to the framework's (torch: the caching
// allocator, a CUDA graph's pool while capturing); without one they fail naming themselves.
void require_env_allocator(const char* function, const char* advice) {
  dmattn::check(TVMFFIEnvGetDLPackManagedTensorAllocator() != nullptr, dmattn::ErrorKind::kRuntime, function,
                ": no tensor allocator in this call's environment", advice);
}

tvm::ffi::Tensor env_empty(std::initializer_list<int64_t> shape, DLDataType dtype, DLDevice device) {
  return tvm::ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, shape, dtype, device);
}

// out of a decode call allocated by the call itself (ForwardParams::allocate_out): like q,
// contiguous, through env_empty. The placeholder stands for its data until then (16-byte
// aligned, never dereferenced).
struct DecodeOut {
  int64_t batch, seqlen_q, heads, head_dim;
  DLDataType dtype;
  DLDevice device;
  tvm::ffi::Tensor tensor;  // (undefined until allocated)
  alignas(256) static inline char placeholder[16];

  static void* allocate(void* self) {
    auto* o = static_cast<DecodeOut*>(self);
    o->tensor = env_empty({o->batch, o->seqlen_q, o->heads, o->head_dim}, o->dtype, o->device);
    return static_cast<char*>(o->tensor.data_ptr()) + o->tensor.byte_offset();
  }
};

// Work a decode call queues before its kernel on the front of its scratch (the top-k selection
// writing the kept positions and their bias there): `elements` float32 values reserved (16-byte
// aligned), `launch` called with their address once the scratch is taken, before the decode
// kernel's arguments are checked (which may read the descriptors it fills in).
struct DecodePrelude {
  int64_t elements = 0;
  std::function<void(float* reserved)> launch;
};

// The decode kernel with out (like q, contiguous), the splits' workspace (for the balanced form
// too where inputs.balanced and the shapes take it) and, where lse is null, an lse nobody reads,
// both in the call's scratch (decode_scratch.h), behind the prelude's values where there is one.
// inputs: the key side but the workspace. out is allocated by the call (DecodeOut): on CUDA with
// key splits after the decode kernel's launch, so that an idle GPU starts that much sooner.
// Returns out.
tvm::ffi::Tensor run_decode_allocating(const dmattn::TensorDesc& q, const dmattn::TensorDesc& k,
                                       const dmattn::TensorDesc& v, const dmattn::TensorDesc* lse,
                                       const dmattn::TensorDesc* mask, const dmattn::TensorDesc* bias,
                                       const dmattn::AttentionOptions& options, dmattn::DecodeInputs inputs,
                                       DLDataType dtype, DLDevice device, const DecodePrelude* prelude = nullptr) {
  const int64_t batch = q.shape[0], seqlen_q = q.shape[1], heads = q.shape[2], head_dim = q.shape[3];
  int64_t num_splits = inputs.num_splits;
  if (inputs.balanced && device.device_type == kDLCUDA) {
    const bool paged = inputs.block_table != nullptr;
    const int64_t seqlen_k = paged ? k.shape[1] * inputs.block_table->shape[1] : k.shape[1];
    num_splits = std::max(num_splits, dmattn::decode_balanced_splits(dmattn::DeviceKind::kCUDA, device.device_id,
                                                                     batch, seqlen_q, heads, k.shape[2], head_dim,
                                                                     seqlen_k));
  }
  DecodeOut out{batch, seqlen_q, heads, head_dim, dtype, device, {}};
  dmattn::TensorDesc out_d = q;  // (q's dtype, device and shape; contiguous, at the placeholder)
  out_d.data = DecodeOut::placeholder;
  out_d.strides = {seqlen_q * heads * head_dim, heads * head_dim, head_dim, 1};
  // The scratch (decode_scratch.h): the prelude's values, the splits' partial rows, then an lse
  // the caller does not want.
  const int64_t rows = batch * heads * seqlen_q, partials = num_splits > 1 ? num_splits * rows * (head_dim + 1) : 0;
  const int64_t reserved = prelude != nullptr ? (prelude->elements + 3) / 4 * 4 : 0;
  const int64_t scratch_elements = reserved + partials + (lse == nullptr ? rows : 0);
  void* stream = device_stream(device);
  dmattn::binding::DecodeScratch scratch;  // (held until the call's launches are queued)
  dmattn::TensorDesc scratch_d;
  if (scratch_elements > 0) {
    scratch = dmattn::binding::decode_scratch(scratch_elements, device, stream);
    scratch_d = to_desc(scratch.tensor);
  }
  if (prelude != nullptr) {
    prelude->launch(static_cast<float*>(scratch_d.data));
    if (reserved > 0) {
      scratch_d.data = static_cast<float*>(scratch_d.data) + reserved;
      scratch_d.shape = {scratch_d.shape[0] - reserved};
    }
  }
  dmattn::TensorDesc workspace_d = scratch_d;
  workspace_d.shape = {partials};  // (the partial rows alone: the scratch may hold more)
  dmattn::TensorDesc lse_d;
  if (lse != nullptr) {
    lse_d = *lse;
  } else {
    lse_d = scratch_d;
    lse_d.data = static_cast<float*>(scratch_d.data) + partials;
    lse_d.shape = {batch, heads, seqlen_q};
    lse_d.strides = {heads * seqlen_q, seqlen_q, 1};
  }
  inputs.workspace = num_splits > 1 ? &workspace_d : nullptr;
  dmattn::ForwardParams p = dmattn::make_decode_forward_params(q, k, v, out_d, lse_d, mask, bias, options, inputs);
  p.stream = stream;
  if (device.device_type == kDLCUDA && p.decode_splits > 0) {  // (the decode kernels: the call allocates)
    p.allocate_out = &DecodeOut::allocate;
    p.allocate_out_context = &out;
  } else {
    p.out = DecodeOut::allocate(&out);
  }
  dmattn::run_forward(p);
  if (!out.tensor.defined()) DecodeOut::allocate(&out);  // (a call that launched nothing: an empty out)
  return out.tensor;
}

// forward_decode with its outputs allocated here, through tvm-ffi's environment allocator (a
// call with torch tensors sets it to torch's: the caching allocator, a CUDA graph's pool while
// capturing): out like q (contiguous), the splits' workspace (float32), and the lse where the
// caller passes none. Returns out. Allocating here spares a decoding step the Python calls around
// each allocation (host time that the GPU waits for when the step starts from idle).
// cache_call: errors name k and v "k_cache" and "v_cache" (dmattn.attention_with_kvcache).
tvm::ffi::Tensor decode_attention(TensorView q, TensorView k, TensorView v, Optional<TensorView> lse,
                                  Optional<TensorView> mask, Optional<TensorView> bias, bool causal,
                                  int64_t window_left, int64_t window_right, double scale, double softcap,
                                  Optional<TensorView> cache_seqlens, Optional<TensorView> block_table,
                                  int64_t num_splits, bool cache_call, Optional<TensorView> key_positions) {
  tvm::ffi::Tensor out;
  translate_errors([&] {
    const dmattn::TensorDesc q_d = to_desc(q), k_d = to_desc(k);
    dmattn::check(q_d.shape.size() == 4, dmattn::ErrorKind::kValue,
                  "q: expected a 4-D tensor (batch, seqlen_q, num_heads, head_dim), got shape ", q_d.shape_text());
    require_env_allocator("decode_attention", " (pass framework tensors, or use forward_decode with the outputs "
                          "allocated)");
    const OptionalDesc lse_d(lse), mask_d(mask), bias_d(bias), seqlens_d(cache_seqlens), table_d(block_table),
        positions_d(key_positions);
    dmattn::DecodeInputs inputs = decode_inputs(seqlens_d, table_d, positions_d, k_d, num_splits);
    // (a cache call may take the balanced form: its rows need not equal another call's bits)
    if (cache_call) inputs.k_name = "k_cache", inputs.v_name = "v_cache", inputs.balanced = true;
    out = run_decode_allocating(q_d, k_d, to_desc(v), lse_d.get(), mask_d.get(), bias_d.get(),
                                make_options(causal, window_left, window_right, scale, softcap, false), inputs,
                                q.dtype(), q.device());
  });
  return out;
}

// Whether the positions of topk_attention's kept keys decide anything beyond which rows are
// read: a causal mask or window tests them; without one every query sees every kept key (the
// selection yields keep valid positions, no padding).
bool positions_decide(const dmattn::AttentionOptions& o) {
  return o.causal || o.window_left >= 0 || o.window_right >= 0;
}

// Whether topk_attention's forward reads the kept K / V rows from a gathered copy rather than
// in place. In place, the producer warps of every query tile copy its kept rows by cp.async
// (TMA's tiled boxes cannot gather rows on sm_90); from a copy, one gather pass writes them
// contiguous and every tile loads them by TMA. The copy pays where every query tile reads every
// kept row (no causal mask or window) and the rows of a kv head are read by at least 16 tiles
// (seqlen_q * group >= 2048): H200, B=2, H=16, 8192 queries, keep 2048, the forward 0.66 ms in
// place against 0.61 from the copy, its gather included (CUDA graphs). Causal, where a tile reads
// part of the rows, both take 0.42 ms, so in place (no copy's memory). DMATTN_TOPK_ROWS_COPY=0 / 1
// forces either (comparisons).
bool kept_rows_copy_pays(int64_t seqlen_q, int64_t heads, int64_t heads_kv, const dmattn::AttentionOptions& o) {
  static const int forced = [] {
    const char* e = std::getenv("DMATTN_TOPK_ROWS_COPY");
    return e == nullptr || *e == 0 ? -1 : (std::string(e) == "0" ? 0 : 1);
  }();
  if (forced >= 0) return forced == 1;
  return !positions_decide(o) && heads_kv > 0 && seqlen_q * (heads / heads_kv) >= 16 * 128;
}

// What run_topk_forward leaves: out (B, Sq, H, D), contiguous; the lse where the caller passed
// none ((B, H, Sq) float32); the kept keys' positions (rows_b, rows_h, keep) int32 and bias
// (rows_b, rows_h, 1, keep) in the bias's dtype. On the decode route out alone: the rest lives in
// the decode call's scratch.
struct TopkForwardResults {
  tvm::ffi::Tensor out, own_lse, positions, kept_bias;
};

// attention_topk's forward over one key set per (batch, kv head) (python/dmattn/topk.py): the top
// `keep` keys of each row of a key-side bias (rows_b, rows_h, 1, Sk) selected
// (select_topk_positions, which also writes their bias), then the forward over them reading the
// kept K / V rows in place (key positions and key rows both the selection) or, where
// kept_rows_copy_pays, from a gathered copy (gather_key_rows), as the Python route composes it
// from select_topk_positions and forward (or forward_decode), with the same arguments, so the same
// bits. decode_splits > 0 (a decoding step: one query, no left window): the decode kernel with
// that many key splits instead of the general forward, each kept row read once per kv head.
// Everything but the caller's lse (optional, (B, H, Sq) float32) is allocated here through
// tvm-ffi's environment allocator, as decode_attention does (the decode route's selection in its
// scratch, decode_scratch.h): one call and no Python allocations, host time that an idle GPU
// waits for. `function` names the export in the allocator's error.
TopkForwardResults run_topk_forward(TensorView q, TensorView k, TensorView v, TensorView bias, int64_t keep,
                                    Optional<TensorView> lse, const dmattn::AttentionOptions& options,
                                    int64_t decode_splits, const char* function) {
  const dmattn::TensorDesc q_d = to_desc(q), k_d = to_desc(k), bias_d = to_desc(bias);
  dmattn::check(q_d.shape.size() == 4, dmattn::ErrorKind::kValue,
                "q: expected a 4-D tensor (batch, seqlen_q, num_heads, head_dim), got shape ", q_d.shape_text());
  dmattn::check(k_d.shape.size() == 4, dmattn::ErrorKind::kValue,
                "k: expected a 4-D tensor (batch, seqlen_k, num_heads_kv, head_dim), got shape ", k_d.shape_text());
  dmattn::check(bias_d.shape.size() == 4 && bias_d.shape[2] == 1, dmattn::ErrorKind::kValue,
                "bias: expected a key-side bias (rows_b, rows_h, 1, Sk), got shape ", bias_d.shape_text());
  require_env_allocator(function, " (pass framework tensors)");
  const auto empty = [&](std::initializer_list<int64_t> shape, DLDataType dtype) {
    return env_empty(shape, dtype, q.device());
  };
  TopkForwardResults r;
  const int64_t rows_b = bias_d.shape[0], rows_h = bias_d.shape[1];
  const OptionalDesc lse_d(lse);
  if (decode_splits > 0) {
    // The kept positions and their bias go to the front of the decode call's scratch, which the
    // eager calls of a stream reuse (decode_scratch.h): the call returns neither, and each
    // allocation before the selection's launch is host time that an idle GPU waits for.
    const int64_t kept = rows_b * rows_h * keep, positions_elements = (kept + 3) / 4 * 4;
    const DLDataType bias_type = bias.dtype();
    dmattn::TensorDesc positions_d = bias_d, kept_bias_d = bias_d;
    positions_d.dtype = dmattn::DType::kInt32;
    positions_d.shape = {rows_b, rows_h, keep};
    positions_d.strides = {rows_h * keep, keep, 1};
    kept_bias_d.shape = {rows_b, rows_h, 1, keep};
    kept_bias_d.strides = {rows_h * keep, keep, keep, 1};
    const DecodePrelude prelude{positions_elements + (kept * (bias_type.bits / 8) + 3) / 4, [&](float* reserved) {
                                  positions_d.data = reserved;
                                  kept_bias_d.data = reserved + positions_elements;
                                  dmattn::select_topk_positions(bias_d, keep, positions_d, &kept_bias_d,
                                                                glue_stream(bias));
                                }};
    dmattn::DecodeInputs inputs;
    inputs.gathered = dmattn::GatheredKeys{&positions_d, k_d.shape[1], nullptr, &positions_d};
    inputs.num_splits = decode_splits;
    r.out = run_decode_allocating(q_d, k_d, to_desc(v), lse_d.get(), nullptr, &kept_bias_d, options, inputs,
                                  q.dtype(), q.device(), &prelude);
    return r;
  }
  r.positions = empty({rows_b, rows_h, keep}, DLDataType{kDLInt, 32, 1});
  r.kept_bias = empty({rows_b, rows_h, 1, keep}, bias.dtype());
  const dmattn::TensorDesc positions_d = to_desc(r.positions), kept_bias_d = to_desc(r.kept_bias);
  const dmattn::GatheredKeys gathered{&positions_d, k_d.shape[1], nullptr, &positions_d};
  // The selection first: the host allocates and prepares the forward while it runs.
  dmattn::select_topk_positions(bias_d, keep, positions_d, &kept_bias_d, glue_stream(bias));
  const int64_t batch = q_d.shape[0], seqlen_q = q_d.shape[1], heads = q_d.shape[2], head_dim = q_d.shape[3];
  const int64_t heads_kv = k_d.shape[2];
  const dmattn::TensorDesc v_d = to_desc(v);
  tvm::ffi::Tensor k_rows, v_rows;  // (copy: (B, keep, Hkv, D), the kept rows)
  dmattn::TensorDesc k_rows_d, v_rows_d;
  const bool copy = kept_rows_copy_pays(seqlen_q, heads, heads_kv, options);
  if (copy) {
    k_rows = empty({batch, keep, heads_kv, head_dim}, k.dtype());
    v_rows = empty({batch, keep, heads_kv, head_dim}, v.dtype());
    k_rows_d = to_desc(k_rows), v_rows_d = to_desc(v_rows);
    dmattn::gather_key_rows(k_d, v_d, positions_d, k_rows_d, v_rows_d, nullptr, nullptr, glue_stream(bias));
  }
  r.out = empty({batch, seqlen_q, heads, head_dim}, q.dtype());
  if (!lse.has_value()) r.own_lse = empty({batch, heads, seqlen_q}, DLDataType{kDLFloat, 32, 1});
  const dmattn::TensorDesc out_d = to_desc(r.out), lse_out_d = lse_d.present ? lse_d.desc : to_desc(r.own_lse);
  // The forward over the copy runs without the positions where they decide nothing, the kept
  // bias a key-side bias, if that broadcasts (one bias row per head or for all heads; a row per
  // kv head under GQA needs the positions' head mapping).
  const bool bias_broadcasts = rows_h == 1 || rows_h == heads;
  const dmattn::GatheredKeys copied = !positions_decide(options) && bias_broadcasts
                                          ? dmattn::GatheredKeys{}
                                          : dmattn::GatheredKeys{&positions_d, k_d.shape[1], nullptr, nullptr};
  dmattn::ForwardParams p = copy ? dmattn::make_forward_params(q_d, k_rows_d, v_rows_d, out_d, lse_out_d, nullptr,
                                                               &kept_bias_d, options, copied)
                                 : dmattn::make_forward_params(q_d, k_d, v_d, out_d, lse_out_d, nullptr,
                                                               &kept_bias_d, options, gathered);
  p.stream = current_stream(p);
  dmattn::run_forward(p);
  return r;
}

// attention_topk's inference form: run_topk_forward, returning out.
tvm::ffi::Tensor topk_attention(TensorView q, TensorView k, TensorView v, TensorView bias, int64_t keep,
                                Optional<TensorView> lse, bool causal, int64_t window_left, int64_t window_right,
                                double scale, double softcap, int64_t decode_splits) {
  tvm::ffi::Tensor out;
  translate_errors([&] {
    const auto options = make_options(causal, window_left, window_right, scale, softcap, false);
    out = run_topk_forward(q, k, v, bias, keep, lse, options, decode_splits, "topk_attention").out;
  });
  return out;
}

// attention_topk's training form, forward (python/dmattn/topk.py): run_topk_forward (the general
// forward, its lse allocated too), returning [out, lse, positions, kept_bias] for the backward
// (topk_attention_backward). One call before the autograd node's own work: the GPU starts on
// the selection while the host records the node.
tvm::ffi::Array<tvm::ffi::Tensor> topk_attention_training(TensorView q, TensorView k, TensorView v, TensorView bias,
                                                          int64_t keep, bool causal, int64_t window_left,
                                                          int64_t window_right, double scale, double softcap) {
  tvm::ffi::Array<tvm::ffi::Tensor> outputs;
  translate_errors([&] {
    const auto options = make_options(causal, window_left, window_right, scale, softcap, false);
    const TopkForwardResults r =
        run_topk_forward(q, k, v, bias, keep, Optional<TensorView>(), options, 0, "topk_attention_training");
    outputs = tvm::ffi::Array<tvm::ffi::Tensor>{r.out, r.own_lse, r.positions, r.kept_bias};
  });
  return outputs;
}

// attention_topk's training form, backward (python/dmattn/topk.py): the gradients of
// topk_attention's forward from the positions and kept bias it selected, as the general route
// computes them (the backward over the kept rows read in place, then scatter_key_rows to full
// size), with the same arguments, so the same bits. dq, dk, dv and, where given, dbias (the
// bias's gradient, (rows_b, rows_h, 1, Sk)) are the caller's, contiguous; the scratch buffers
// (the kept rows' gradients, Delta, the float32 dQ accumulator and, for a bias broadcast over
// batch or heads, dbias's accumulator) are allocated here through tvm-ffi's environment
// allocator: one crossing of the binding for the whole backward.
void topk_attention_backward(TensorView dout, TensorView q, TensorView k, TensorView v, TensorView out,
                             TensorView lse, TensorView positions, TensorView kept_bias, bool causal,
                             int64_t window_left, int64_t window_right, double scale, double softcap, TensorView dq,
                             TensorView dk, TensorView dv, Optional<TensorView> dbias) {
  translate_errors([&] {
    const dmattn::TensorDesc q_d = to_desc(q), k_d = to_desc(k), positions_d = to_desc(positions),
                             kept_bias_d = to_desc(kept_bias);
    dmattn::check(q_d.shape.size() == 4, dmattn::ErrorKind::kValue,
                  "q: expected a 4-D tensor (batch, seqlen_q, num_heads, head_dim), got shape ", q_d.shape_text());
    dmattn::check(k_d.shape.size() == 4, dmattn::ErrorKind::kValue,
                  "k: expected a 4-D tensor (batch, seqlen_k, num_heads_kv, head_dim), got shape ", k_d.shape_text());
    dmattn::check(positions_d.shape.size() == 3 && kept_bias_d.shape.size() == 4, dmattn::ErrorKind::kValue,
                  "positions, kept_bias: expected (rows_b, rows_h, K) and (rows_b, rows_h, 1, K), got ",
                  positions_d.shape_text(), " and ", kept_bias_d.shape_text());
    require_env_allocator("topk_attention_backward", " (pass framework tensors)");
    const auto empty = [&](std::initializer_list<int64_t> shape, DLDataType dtype) {
      return env_empty(shape, dtype, q.device());
    };
    const DLDataType f32{kDLFloat, 32, 1};
    const int64_t batch = q_d.shape[0], seqlen_q = q_d.shape[1], heads = q_d.shape[2], head_dim = q_d.shape[3];
    const int64_t heads_kv = k_d.shape[2], width = positions_d.shape[2];
    const int64_t rows_b = kept_bias_d.shape[0], rows_h = kept_bias_d.shape[1];
    const tvm::ffi::Tensor dk_rows = empty({batch, width, heads_kv, head_dim}, k.dtype());
    const tvm::ffi::Tensor dv_rows = empty({batch, width, heads_kv, head_dim}, v.dtype());
    const tvm::ffi::Tensor delta = empty({batch, heads, seqlen_q}, f32);
    const tvm::ffi::Tensor dq_accum = empty({batch, seqlen_q, heads, head_dim}, f32);
    tvm::ffi::Tensor dbias_rows, dbias_accum;
    dmattn::TensorDesc dbias_rows_d, dbias_accum_d;
    if (dbias.has_value()) {
      dbias_rows = empty({rows_b, rows_h, 1, width}, kept_bias.dtype());
      dbias_rows_d = to_desc(dbias_rows);
      // (a bias broadcast over batch or heads is reduced in float32 by the kernels)
      if (rows_b < batch || rows_h < heads) {
        dbias_accum = empty({rows_b, rows_h, 1, width}, f32);
        dbias_accum_d = to_desc(dbias_accum);
      }
    }
    const dmattn::TensorDesc dk_rows_d = to_desc(dk_rows), dv_rows_d = to_desc(dv_rows), delta_d = to_desc(delta),
                             dq_accum_d = to_desc(dq_accum);
    const dmattn::GatheredKeys gathered{&positions_d, k_d.shape[1], nullptr, &positions_d};
    dmattn::BackwardParams p = dmattn::make_backward_params(
        q_d, k_d, to_desc(v), to_desc(out), to_desc(lse), nullptr, &kept_bias_d, to_desc(dout), to_desc(dq), dk_rows_d,
        dv_rows_d, dbias.has_value() ? &dbias_rows_d : nullptr, &delta_d, &dq_accum_d,
        dbias_accum.defined() ? &dbias_accum_d : nullptr,
        make_options(causal, window_left, window_right, scale, softcap, false), gathered);
    p.fwd.stream = current_stream(p.fwd);
    dmattn::run_backward(p);
    const OptionalDesc dbias_d(dbias);
    dmattn::scatter_key_rows(dk_rows_d, dv_rows_d, positions_d, to_desc(dk), to_desc(dv),
                             dbias.has_value() ? &dbias_rows_d : nullptr, dbias_d.get(), p.fwd.stream);
  });
}

// Whether decode_attention can allocate in a call with these arguments' framework (torch
// exports its allocator to tvm-ffi from 2.10 on; older versions may not).
bool has_env_allocator(TensorView /*a tensor of the framework*/) {
  return TVMFFIEnvGetDLPackManagedTensorAllocator() != nullptr;
}

int64_t decode_splits(const std::string& device, int64_t device_id, int64_t batch, int64_t seqlen_q,
                      int64_t num_heads, int64_t num_heads_kv, int64_t head_dim, int64_t seqlen_k,
                      int64_t max_rows) {
  const auto kind = device == "cuda" ? dmattn::DeviceKind::kCUDA : dmattn::DeviceKind::kCPU;
  int64_t splits = 0;
  translate_errors([&] {
    splits = dmattn::decode_splits(kind, static_cast<int32_t>(device_id), batch, seqlen_q, num_heads,
                                   num_heads_kv, head_dim, seqlen_k, max_rows);
  });
  return splits;
}

// The balanced form's workspace in splits for attention_with_kvcache's calls of these shapes on
// CUDA device device_id, 0 where they do not take it (dmattn/api.h).
int64_t decode_balanced_splits(int64_t device_id, int64_t batch, int64_t seqlen_q, int64_t num_heads,
                               int64_t num_heads_kv, int64_t head_dim, int64_t seqlen_k) {
  int64_t splits = 0;
  translate_errors([&] {
    splits = dmattn::decode_balanced_splits(dmattn::DeviceKind::kCUDA, static_cast<int32_t>(device_id), batch,
                                            seqlen_q, num_heads, num_heads_kv, head_dim, seqlen_k);
  });
  return splits;
}

int64_t decode_packed_splits(int64_t device_id, int64_t num_heads, int64_t num_heads_kv, int64_t head_dim,
                             int64_t max_seqlen_q, int64_t max_seqlen_k) {
  int64_t splits = 0;
  translate_errors([&] {
    splits = dmattn::decode_packed_splits(dmattn::DeviceKind::kCUDA, static_cast<int32_t>(device_id), num_heads,
                                          num_heads_kv, head_dim, max_seqlen_q, max_seqlen_k);
  });
  return splits;
}

bool cuda_available() { return dmattn::cuda_available(); }

#ifndef DMATTN_BUILD_INFO
#define DMATTN_BUILD_INFO ""
#endif
// What this build contains: "cuda=1 archs=80,90a ptx=80 cuda_version=13.0.88 blas=1"
// (CMakeLists.txt).
std::string build_info() { return DMATTN_BUILD_INFO; }

// The code CUDA device `device_id` runs (dmattn::cuda_kernel_code): "binary=90 ptx=80".
std::string kernel_code(int64_t device_id) {
  dmattn::CudaKernelCode code;
  translate_errors([&] { code = dmattn::cuda_kernel_code(static_cast<int32_t>(device_id)); });
  return "binary=" + std::to_string(code.binary_arch) + " ptx=" + std::to_string(code.ptx_arch);
}

// dmattn::set_persistent_kernels for the calling thread; returns the previous setting.
bool set_persistent_kernels(bool allowed) { return dmattn::set_persistent_kernels(allowed); }

// Whether forward/backward accept key_positions for tensors on `device` ("cpu", "cuda").
bool supports_key_positions(const std::string& device) {
  if (device == "cpu") return dmattn::key_positions_supported(dmattn::DeviceKind::kCPU);
  if (device == "cuda") return dmattn::key_positions_supported(dmattn::DeviceKind::kCUDA);
  return false;
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward, forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backward, backward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward_varlen, forward_varlen);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backward_varlen, backward_varlen);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(check_cu_seqlens, check_cu_seqlens);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(cuda_available, cuda_available);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward_decode, forward_decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_splits, decode_splits);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_packed_splits, decode_packed_splits);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_balanced_splits, decode_balanced_splits);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(forward_varlen_decode, forward_varlen_decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_attention, decode_attention);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(topk_attention, topk_attention);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(topk_attention_training, topk_attention_training);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(topk_attention_backward, topk_attention_backward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(has_env_allocator, has_env_allocator);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(build_info, build_info);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(kernel_code, kernel_code);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_persistent_kernels, set_persistent_kernels);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(supports_key_positions, supports_key_positions);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(select_topk_positions, select_topk_positions);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gate_keep_cells, gate_keep_cells);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_key_rows, gather_key_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(scatter_key_rows, scatter_key_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(prefix_thresholds, prefix_thresholds);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(interval_ends, interval_ends);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(selection_key, selection_key);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(segment_candidates, segment_candidates);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gather_segment_rows, gather_segment_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sum_segment_rows, sum_segment_rows);
