// Standalone GPU check of dmattn::cuda::forward (no src/api): random inputs, NaN-poisoned
// outputs (plus a guard region after out), a naive fp32 reference kernel, a table of configs,
// and one timed large config.
//   nvcc -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//        -I include -I src -I $CUTLASS tests/cuda/standalone_check.cu src/cuda/host/cuda_backend.cu \
//        src/cuda/inst/fwd_*.cu -o standalone_check
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/host/cuda_backend.h"
#include "dmattn/error.h"
#include "dmattn/params.h"

using namespace dmattn;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(1); } } while (0)

// ---- reference ---------------------------------------------------------------------------------
struct RefOp {  // broadcast operand as seen by the reference
  const void* ptr; int kind;  // kind 0 bool, 1 fp32, 2 bf16, 3 fp16
  long long sb, sh, sq, sk; int head_div;
};
__device__ float ld_elem(const void* p, long long i, int elem_kind) {  // 2 bf16, 3 fp16
  if (elem_kind == 2) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return __half2float(static_cast<const __half*>(p)[i]);
}
__device__ float ld_op(const RefOp& o, int b, int h, long long i, long long j) {
  long long off = b * o.sb + (long long)(h / o.head_div) * o.sh + i * o.sq + j * o.sk;
  if (o.kind == 0) return static_cast<const unsigned char*>(o.ptr)[off] ? 1.f : 0.f;
  if (o.kind == 1) return static_cast<const float*>(o.ptr)[off];
  return ld_elem(o.ptr, off, o.kind);
}

struct RefArgs {
  const void *q, *k, *v; int ek;  // element kind 2/3
  int B, Sq, Sk, H, Hkv, D; float scale, softcap; long long wl, wr;
  RefOp mask, bias;
  float* out; float* lse;  // out (B,Sq,H,D) contiguous
};

__global__ void ref_kernel(RefArgs a) {
  long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (t >= (long long)a.B * a.H * a.Sq) return;
  int i = t % a.Sq, h = (t / a.Sq) % a.H, b = t / ((long long)a.Sq * a.H);
  int hk = h / (a.H / a.Hkv);
  const long long qo = (((long long)b * a.Sq + i) * a.H + h) * a.D;
  float qv[256];
  for (int d = 0; d < a.D; ++d) qv[d] = ld_elem(a.q, qo + d, a.ek);
  auto score = [&](int j, bool& ok) {
    long long ko = (((long long)b * a.Sk + j) * a.Hkv + hk) * a.D;
    float s = 0.f;
    for (int d = 0; d < a.D; ++d) s += qv[d] * ld_elem(a.k, ko + d, a.ek);
    s *= a.scale;
    if (a.softcap > 0) s = a.softcap * tanhf(s / a.softcap);
    ok = true;
    long long dd = (long long)i + a.Sk - a.Sq;
    if (a.wl >= 0 && j < dd - a.wl) ok = false;
    if (a.wr >= 0 && j > dd + a.wr) ok = false;
    if (a.mask.ptr && ld_op(a.mask, b, h, i, j) == 0.f) ok = false;
    if (a.bias.ptr) { float bv = ld_op(a.bias, b, h, i, j); if (bv == -INFINITY) ok = false; s += bv; }
    return s;
  };
  float m = -INFINITY;
  for (int j = 0; j < a.Sk; ++j) { bool ok; float s = score(j, ok); if (ok) m = fmaxf(m, s); }
  float acc[256];
  for (int d = 0; d < a.D; ++d) acc[d] = 0.f;
  float l = 0.f;
  if (m != -INFINITY) {
    for (int j = 0; j < a.Sk; ++j) {
      bool ok; float s = score(j, ok);
      if (!ok) continue;
      float p = expf(s - m);
      l += p;
      long long vo = (((long long)b * a.Sk + j) * a.Hkv + hk) * a.D;
      for (int d = 0; d < a.D; ++d) acc[d] += p * ld_elem(a.v, vo + d, a.ek);
    }
  }
  for (int d = 0; d < a.D; ++d) a.out[qo + d] = l > 0 ? acc[d] / l : 0.f;
  a.lse[((long long)b * a.H + h) * a.Sq + i] = l > 0 ? m + logf(l) : -INFINITY;
}

// ---- host helpers ------------------------------------------------------------------------------
static uint16_t to_bits(float x, bool bf16) {
  if (bf16) { __nv_bfloat16 v = __float2bfloat16(x); uint16_t r; memcpy(&r, &v, 2); return r; }
  __half v = __float2half(x); uint16_t r; memcpy(&r, &v, 2); return r;
}
static float from_bits(uint16_t u, bool bf16) {
  if (bf16) { __nv_bfloat16 v; memcpy(&v, &u, 2); return __bfloat162float(v); }
  __half v; memcpy(&v, &u, 2); return __half2float(v);
}

template <typename T> T* dev_upload(const std::vector<T>& h) {
  T* d; CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Operand shape: sizes (b, h, q, k); h_kind 0 = 1, 1 = Hkv, 2 = H.
struct OpShape { bool present = false; bool b = true; int h_kind = 2; bool q = true; bool k = true; };

struct Cfg {
  const char* name; bool bf16; int B, H, Hkv, Sq, Sk, D; bool causal; long long wl, wr;
  OpShape mask; float mask_p;  // probability of true
  OpShape bias; bool bias_fp32; float special_p;  // probability of -inf / finfo.min in bias
  float softcap; int empty_row;  // a query row whose mask is all false (-1 none)
  int mask_pattern = 0;  // 0 random; 1 block-sparse: (i/128 + j/128) % 3 == 0 random, else false;
                         // 2 key runs: keys with (j / 200) % 2 == 1 false (whole key blocks empty)
};

struct OpBuf { void* dev = nullptr; BroadcastOperand op; RefOp ref; };

static OpBuf make_op(const OpShape& s, const Cfg& c, int kind, std::mt19937& rng, bool is_mask) {
  OpBuf r;
  if (!s.present) { r.ref.ptr = nullptr; return r; }
  long long nb = s.b ? c.B : 1, nh = s.h_kind == 0 ? 1 : (s.h_kind == 1 ? c.Hkv : c.H), nq = s.q ? c.Sq : 1, nk = s.k ? c.Sk : 1;
  long long sk = nk == 1 ? 0 : 1, sq = nq == 1 ? 0 : nk, sh = nh == 1 ? 0 : nk * nq, sb = nb == 1 ? 0 : nk * nq * nh;
  long long n = nb * nh * nq * nk;
  int hd = (s.h_kind == 1) ? c.H / c.Hkv : 1;
  std::uniform_real_distribution<float> U(0.f, 1.f);
  std::normal_distribution<float> N(0.f, 1.f);
  if (is_mask) {
    std::vector<uint8_t> h(n);
    for (long long bb = 0; bb < nb; ++bb) for (long long hh = 0; hh < nh; ++hh)
      for (long long i = 0; i < nq; ++i) for (long long j = 0; j < nk; ++j) {
        bool v = U(rng) < c.mask_p;
        if (c.mask_pattern == 1 && (i / 128 + j / 128) % 3 != 0) v = false;
        if (c.mask_pattern == 2 && (j / 200) % 2 == 1) v = false;
        h[bb * sb + hh * sh + i * sq + j * sk] = v;
      }
    if (c.empty_row >= 0 && nq > 1 && c.empty_row < nq)
      for (long long bb = 0; bb < nb; ++bb) for (long long hh = 0; hh < nh; ++hh) for (long long j = 0; j < nk; ++j)
        h[bb * sb + hh * sh + c.empty_row * sq + j * sk] = 0;
    r.dev = dev_upload(h);
    r.op.dtype = DType::kBool;
  } else {
    const float fmin = kind == 1 ? -3.4028234663852886e38f : (c.bf16 ? -3.3895313892515355e38f : -65504.f);
    std::vector<float> f(n);
    for (long long e = 0; e < n; ++e) {
      float u = U(rng);
      f[e] = u < c.special_p ? -INFINITY : (u < 2 * c.special_p ? fmin : N(rng));
    }
    if (kind == 1) { r.dev = dev_upload(f); r.op.dtype = DType::kFloat32; }
    else {
      std::vector<uint16_t> h(n);
      for (long long e = 0; e < n; ++e) h[e] = to_bits(f[e], c.bf16);
      r.dev = dev_upload(h); r.op.dtype = c.bf16 ? DType::kBFloat16 : DType::kFloat16;
    }
  }
  r.op.ptr = r.dev;
  r.op.stride_b = sb; r.op.stride_h = sh; r.op.stride_q = sq; r.op.stride_k = sk;
  r.op.size_b = nb; r.op.size_h = nh; r.op.size_q = nq; r.op.size_k = nk; r.op.head_div = hd;
  r.ref = RefOp{r.dev, kind, sb, sh, sq, sk, hd};
  return r;
}

static int run_cfg(const Cfg& c, std::mt19937& rng) {
  const bool bf = c.bf16;
  const long long nq = (long long)c.B * c.Sq * c.H * c.D, nk = (long long)c.B * c.Sk * c.Hkv * c.D;
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<uint16_t> hq(nq), hk(nk), hv(nk);
  for (auto& x : hq) x = to_bits(N(rng), bf);
  for (auto& x : hk) x = to_bits(N(rng), bf);
  for (auto& x : hv) x = to_bits(N(rng), bf);
  uint16_t *dq = dev_upload(hq), *dk = dev_upload(hk), *dv = dev_upload(hv);
  const long long guard = 4096;
  uint16_t* dout; CK(cudaMalloc(&dout, (nq + guard) * 2)); CK(cudaMemset(dout, 0xFF, (nq + guard) * 2));
  const long long nl = (long long)c.B * c.H * c.Sq;
  float* dlse; CK(cudaMalloc(&dlse, std::max(nl, 1LL) * 4 + guard * 4)); CK(cudaMemset(dlse, 0xFF, std::max(nl, 1LL) * 4 + guard * 4));
  OpBuf mask = make_op(c.mask, c, 0, rng, true);
  OpBuf bias = make_op(c.bias, c, c.bias_fp32 ? 1 : (bf ? 2 : 3), rng, false);

  ForwardParams p;
  p.dtype = bf ? DType::kBFloat16 : DType::kFloat16; p.device = DeviceKind::kCUDA;
  p.batch = c.B; p.seqlen_q = c.Sq; p.seqlen_k = c.Sk; p.num_heads = c.H; p.num_heads_kv = c.Hkv; p.head_dim = c.D;
  p.q = dq; p.q_strides = {(long long)c.Sq * c.H * c.D, (long long)c.H * c.D, c.D};
  p.k = dk; p.k_strides = {(long long)c.Sk * c.Hkv * c.D, (long long)c.Hkv * c.D, c.D};
  p.v = dv; p.v_strides = p.k_strides;
  p.out = dout; p.out_strides = p.q_strides; p.lse = dlse;
  p.mask = mask.op; p.bias = bias.op;
  p.scale = 1.0 / std::sqrt((double)c.D); p.softcap = c.softcap; p.causal = c.causal;
  p.window_left = c.wl; p.window_right = c.causal ? 0 : c.wr;
  try { cuda::forward(p); } catch (const Error& e) { printf("%-34s THROW %s\n", c.name, e.what()); return 1; }
  CK(cudaDeviceSynchronize());

  float *rout, *rlse; CK(cudaMalloc(&rout, std::max(nq, 1LL) * 4)); CK(cudaMalloc(&rlse, std::max(nl, 1LL) * 4));
  RefArgs ra{dq, dk, dv, bf ? 2 : 3, c.B, c.Sq, c.Sk, c.H, c.Hkv, c.D, (float)p.scale, c.softcap, p.window_left, p.window_right,
             mask.ref, bias.ref, rout, rlse};
  if (!c.mask.present) ra.mask.ptr = nullptr;
  if (!c.bias.present) ra.bias.ptr = nullptr;
  if (nl > 0) ref_kernel<<<(nl + 127) / 128, 128>>>(ra);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());

  std::vector<uint16_t> o(nq + guard); std::vector<float> l(nl + guard), ro(nq), rl(nl);
  CK(cudaMemcpy(o.data(), dout, (nq + guard) * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(l.data(), dlse, (nl + guard) * 4, cudaMemcpyDeviceToHost));
  if (nq) CK(cudaMemcpy(ro.data(), rout, nq * 4, cudaMemcpyDeviceToHost));
  if (nl) CK(cudaMemcpy(rl.data(), rlse, nl * 4, cudaMemcpyDeviceToHost));
  double max_err = 0, max_ref = 0, max_lse_err = 0;
  long long nonfinite = 0, lse_bad = 0, guard_bad = 0, empty_rows = 0, empty_bad = 0;
  for (long long e = 0; e < nq; ++e) {
    float x = from_bits(o[e], bf);
    if (!std::isfinite(x)) { ++nonfinite; continue; }
    max_err = std::max(max_err, (double)std::fabs(x - ro[e]));
    max_ref = std::max(max_ref, (double)std::fabs(ro[e]));
  }
  for (long long e = 0; e < guard; ++e) guard_bad += o[nq + e] != 0xFFFF;
  for (long long e = 0; e < nl; ++e) {
    if (rl[e] == -INFINITY) {
      ++empty_rows;
      if (l[e] != -INFINITY) ++empty_bad;
      // out must be exactly 0 for that row
      long long b = e / ((long long)c.H * c.Sq), h = (e / c.Sq) % c.H, i = e % c.Sq;
      for (int d = 0; d < c.D; ++d) if (from_bits(o[((b * c.Sq + i) * c.H + h) * c.D + d], bf) != 0.f) { ++empty_bad; break; }
    } else if (!std::isfinite(l[e])) ++lse_bad;
    else max_lse_err = std::max(max_lse_err, (double)std::fabs(l[e] - rl[e]));
  }
  for (long long e = 0; e < guard; ++e) { uint32_t u; memcpy(&u, &l[nl + e], 4); guard_bad += u != 0xFFFFFFFFu; }
  const double tol = (bf ? 2.5e-2 : 4e-3) * std::max(1.0, max_ref);
  const bool ok = nonfinite == 0 && lse_bad == 0 && guard_bad == 0 && empty_bad == 0 && max_err <= tol && max_lse_err <= 5e-3 * std::max(1.0, 0.0) + 1e-2;
  printf("%-34s %s  max_err %.3e (tol %.1e)  lse_err %.2e  nonfinite %lld  lse_bad %lld  empty %lld/%lld bad  guard_bad %lld\n",
         c.name, ok ? "OK  " : "FAIL", max_err, tol, max_lse_err, nonfinite, lse_bad, empty_bad, empty_rows, guard_bad);
  cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(dout); cudaFree(dlse); cudaFree(rout); cudaFree(rlse);
  if (mask.dev) cudaFree(mask.dev);
  if (bias.dev) cudaFree(bias.dev);
  return ok ? 0 : 1;
}

// Device fills for the large timed operands (host generation of 2^31 elements is too slow).
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__global__ void fill_bias_bf16(__nv_bfloat16* p, long long n, uint32_t seed) {
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
    const uint32_t h = hash32(e * 0x9E3779B97F4A7C15ULL + seed);
    p[e] = __float2bfloat16((h & 0xffff) * (4.f / 65536.f) - 2.f);  // uniform in [-2, 2)
  }
}
__global__ void fill_mask_tiles(uint8_t* p, long long rows, int S) {  // (B*H*S, S): tile (i/128 + j/128) % 4 == 0
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < rows * S; e += (long long)gridDim.x * blockDim.x) {
    const long long i = (e / S) % S, j = e % S;
    p[e] = ((i / 128 + j / 128) % 4 == 0) && (hash32(e) & 1);
  }
}

static std::string g_time_filter;  // '|'-separated substrings of the timed names ("" = all)
static bool time_selected(const std::string& name) {
  if (g_time_filter.empty()) return true;
  size_t start = 0;
  while (start <= g_time_filter.size()) {
    size_t end = g_time_filter.find('|', start);
    if (end == std::string::npos) end = g_time_filter.size();
    if (end > start && name.find(g_time_filter.substr(start, end - start)) != std::string::npos) return true;
    start = end + 1;
  }
  return false;
}

static void time_cfg(const char* name, int B, int H, int S, int D, bool causal, int bias_kind, int mask_kind = 0) {
  if (!time_selected(name)) return;
  // bias_kind: 0 none, 1 dense (B,H,S,S) bf16, 2 per-key (B,H,1,S) bf16
  // mask_kind: 0 none, 1 per-key (B,H,1,S) bool keeping 2048 random keys per head (Doge),
  //            2 full (B,H,S,S) bool, block-sparse: 128x128 tiles kept when (i/128 + j/128) % 4 == 0
  const long long n = (long long)B * S * H * D;
  std::vector<uint16_t> h(n);
  std::mt19937 rng(1); std::normal_distribution<float> N(0.f, 1.f);
  for (auto& x : h) x = to_bits(N(rng), true);
  uint16_t *dq = dev_upload(h), *dk = dev_upload(h), *dv = dev_upload(h), *dout;
  CK(cudaMalloc(&dout, n * 2));
  float* dlse; CK(cudaMalloc(&dlse, (long long)B * H * S * 4));
  void* dbias = nullptr;
  ForwardParams p;
  p.dtype = DType::kBFloat16; p.device = DeviceKind::kCUDA;
  p.batch = B; p.seqlen_q = S; p.seqlen_k = S; p.num_heads = H; p.num_heads_kv = H; p.head_dim = D;
  p.q = dq; p.k = dk; p.v = dv; p.out = dout; p.lse = dlse;
  p.q_strides = p.k_strides = p.v_strides = p.out_strides = {(long long)S * H * D, (long long)H * D, D};
  p.scale = 1.0 / std::sqrt((double)D); p.causal = causal; p.window_right = causal ? 0 : -1;
  if (bias_kind) {
    long long nb = bias_kind == 1 ? (long long)B * H * S * S : (long long)B * H * S;
    CK(cudaMalloc(&dbias, nb * 2)); CK(cudaMemset(dbias, 0, nb * 2));
    p.bias.ptr = dbias; p.bias.dtype = DType::kBFloat16;
    p.bias.size_b = B; p.bias.size_h = H; p.bias.size_q = bias_kind == 1 ? S : 1; p.bias.size_k = S;
    p.bias.stride_k = 1; p.bias.stride_q = bias_kind == 1 ? S : 0;
    p.bias.stride_h = bias_kind == 1 ? (long long)S * S : S; p.bias.stride_b = p.bias.stride_h * H;
  }
  void* dmask = nullptr;
  if (mask_kind) {
    long long nm = mask_kind == 1 ? (long long)B * H * S : (long long)B * H * S * S;
    if (mask_kind == 1) {
      std::vector<uint8_t> hm(nm, 0);
      std::vector<int> idx(S);
      for (long long r = 0; r < (long long)B * H; ++r) {
        for (int j = 0; j < S; ++j) idx[j] = j;
        std::shuffle(idx.begin(), idx.end(), rng);
        for (int j = 0; j < std::min(S, 2048); ++j) hm[r * S + idx[j]] = 1;
      }
      dmask = dev_upload(hm);
    } else {
      CK(cudaMalloc(&dmask, nm));
      fill_mask_tiles<<<4096, 256>>>(static_cast<uint8_t*>(dmask), (long long)B * H * S, S);
      CK(cudaGetLastError());
    }
    p.mask.ptr = dmask; p.mask.dtype = DType::kBool;
    p.mask.size_b = B; p.mask.size_h = H; p.mask.size_q = mask_kind == 1 ? 1 : S; p.mask.size_k = S;
    p.mask.stride_k = 1; p.mask.stride_q = mask_kind == 1 ? 0 : S;
    p.mask.stride_h = mask_kind == 1 ? S : (long long)S * S; p.mask.stride_b = p.mask.stride_h * H;
  }
  if (bias_kind) {  // random bias values (not zeros)
    long long nb = bias_kind == 1 ? (long long)B * H * S * S : (long long)B * H * S;
    fill_bias_bf16<<<4096, 256>>>(static_cast<__nv_bfloat16*>(dbias), nb, 7u);
    CK(cudaGetLastError());
  }
  for (int w = 0; w < 3; ++w) cuda::forward(p);
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < 20; ++r) {
    CK(cudaEventRecord(e0)); cuda::forward(p); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  const double ms = ts[ts.size() / 2];
  const double flops = 4.0 * B * H * (double)S * S * D * (causal ? 0.5 : 1.0);
  printf("TIME %-44s median %.3f ms  %.1f TFLOP/s\n", name, ms, flops / ms / 1e9);
  cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(dout); cudaFree(dlse); if (dbias) cudaFree(dbias);
  if (dmask) cudaFree(dmask);
}

int main(int argc, char** argv) {
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  std::mt19937 rng(1234);
  const OpShape none;
  OpShape full{true, true, 2, true, true}, head_kv{true, true, 1, true, true}, per_key{true, true, 2, false, true};
  OpShape key1{true, true, 2, true, false}, bcast_bh{true, false, 0, true, true}, qk_only{true, false, 0, false, true};
  std::vector<Cfg> cfgs = {
      // name, bf16, B, H, Hkv, Sq, Sk, D, causal, wl, wr, mask, mask_p, bias, fp32, special, softcap, empty_row
      {"bf16 d64 128x128", true, 2, 4, 4, 128, 128, 64, false, -1, -1, none, 1, none, false, 0, 0, -1},
      {"bf16 d128 1000x1000", true, 1, 4, 4, 1000, 1000, 128, false, -1, -1, none, 1, none, false, 0, 0, -1},
      {"fp16 d128 1000x1000", false, 1, 4, 4, 1000, 1000, 128, false, -1, -1, none, 1, none, false, 0, 0, -1},
      {"fp16 d64 len1", false, 2, 2, 2, 1, 1, 64, false, -1, -1, none, 1, none, false, 0, 0, -1},
      {"bf16 d64 17x17 causal", true, 2, 2, 2, 17, 17, 64, true, -1, -1, none, 1, none, false, 0, 0, -1},
      {"bf16 d128 127x1000 causal", true, 1, 3, 3, 127, 1000, 128, true, -1, -1, none, 1, none, false, 0, 0, -1},
      {"bf16 d128 1000x127 causal(empty)", true, 1, 3, 3, 1000, 127, 128, true, -1, -1, none, 1, none, false, 0, 0, -1},
      {"fp16 d64 4097x4097 causal", false, 1, 2, 2, 4097, 4097, 64, true, -1, -1, none, 1, none, false, 0, 0, -1},
      {"bf16 d72 127x1000", true, 1, 2, 2, 127, 1000, 72, false, -1, -1, none, 1, none, false, 0, 0, -1},
      {"fp16 d72 1000x127 window(64,8)", false, 1, 2, 2, 1000, 127, 72, false, 64, 8, none, 1, none, false, 0, 0, -1},
      {"bf16 d128 1000x1000 window(100,0)", true, 1, 2, 2, 1000, 1000, 128, false, 100, 0, none, 1, none, false, 0, 0, -1},
      {"bf16 d64 GQA 8/2 1000x1000", true, 2, 8, 2, 1000, 1000, 64, false, -1, -1, none, 1, none, false, 0, 0, -1},
      {"bf16 d64 softcap 30", true, 1, 2, 2, 127, 1000, 64, false, -1, -1, none, 1, none, false, 0, 30.f, -1},
      {"bf16 d128 mask full 1000", true, 2, 2, 2, 1000, 1000, 128, false, -1, -1, full, 0.5f, none, false, 0, 0, 3},
      {"bf16 d128 mask full 1024(vec)", true, 1, 2, 2, 1024, 1024, 128, false, -1, -1, full, 0.3f, none, false, 0, 0, 5},
      {"fp16 d64 mask head=Hkv GQA", false, 2, 4, 2, 127, 1000, 64, false, -1, -1, head_kv, 0.5f, none, false, 0, 0, 7},
      {"bf16 d64 mask (1,1,1,Sk)", true, 2, 2, 2, 127, 1000, 64, true, -1, -1, qk_only, 0.5f, none, false, 0, 0, -1},
      {"bf16 d128 bias full bf16", true, 2, 2, 2, 1000, 1000, 128, false, -1, -1, none, 1, full, false, 0, 0, -1},
      {"bf16 d128 bias full fp32 specials", true, 1, 2, 2, 1000, 1000, 128, false, -1, -1, none, 1, full, true, 0.05f, 0, -1},
      {"fp16 d128 bias full fp16 specials", false, 1, 2, 2, 1024, 1024, 128, true, -1, -1, none, 1, full, false, 0.05f, 0, -1},
      {"bf16 d64 bias per-key (B,H,1,Sk)", true, 2, 4, 4, 1000, 1000, 64, false, -1, -1, none, 1, per_key, false, 0, 0, -1},
      {"bf16 d64 bias key-dim-1 (B,H,Sq,1)", true, 2, 2, 2, 127, 1000, 64, false, -1, -1, none, 1, key1, true, 0, 0, -1},
      {"bf16 d128 bias (1,1,Sq,Sk) 17", true, 2, 2, 2, 17, 17, 128, false, -1, -1, none, 1, bcast_bh, false, 0.1f, 0, -1},
      {"fp16 d64 bias head=Hkv fp32 GQA", false, 1, 8, 2, 1000, 1000, 64, true, -1, -1, none, 1, head_kv, true, 0.02f, 0, -1},
      {"bf16 d128 mask+bias+window+softcap", true, 2, 4, 2, 1000, 4097, 128, false, 300, 50, full, 0.7f, per_key, true, 0.05f, 20.f, 2},
      {"bf16 d64 all -inf bias rows", true, 1, 2, 2, 127, 127, 64, false, -1, -1, none, 1, full, true, 0.5f, 0, -1},
      {"bf16 d64 mask all false", true, 1, 2, 2, 127, 127, 64, false, -1, -1, full, 0.0f, none, false, 0, 0, -1},
      {"fp16 d128 Sk=0", false, 1, 2, 2, 17, 0, 128, false, -1, -1, none, 1, none, false, 0, 0, -1},
      // head dims on the hd256 instantiation, odd sizes, D=40/80
      {"bf16 d256 1000x1000", true, 1, 2, 2, 1000, 1000, 256, false, -1, -1, none, 1, none, false, 0, 0, -1},
      {"fp16 d256 127x4097 causal", false, 1, 2, 2, 127, 4097, 256, true, -1, -1, none, 1, none, false, 0, 0, -1},
      {"bf16 d200 GQA mask+bias", true, 1, 4, 2, 1000, 1000, 200, false, -1, -1, full, 0.5f, full, false, 0.02f, 0, 4},
      {"fp16 d256 per-key mask+bias causal", false, 2, 2, 2, 1000, 1000, 256, true, -1, -1, per_key, 0.3f, per_key, true, 0, 0, -1},
      {"bf16 d256 softcap 17x17", true, 1, 2, 2, 17, 17, 256, false, -1, -1, none, 1, none, false, 0, 30.f, -1},
      {"bf16 d40 1000x1000 causal", true, 1, 2, 2, 1000, 1000, 40, true, -1, -1, none, 1, none, false, 0, 0, -1},
      {"fp16 d80 4097x1000", false, 1, 2, 2, 4097, 1000, 80, false, -1, -1, none, 1, none, false, 0, 0, -1},
      // block skipping: empty mask tiles (full and query-broadcast masks)
      {"bf16 d128 mask block-sparse 1000", true, 2, 2, 2, 1000, 1000, 128, false, -1, -1, full, 0.5f, none, false, 0, 0, -1, 1},
      {"fp16 d64 mask block-sparse+bias 1024", false, 1, 2, 2, 1024, 1024, 64, false, -1, -1, full, 0.3f, full, false, 0, 0, 9, 1},
      {"bf16 d128 mask block-sparse causal", true, 1, 2, 2, 1024, 1024, 128, true, -1, -1, full, 0.5f, none, false, 0, 0, -1, 1},
      {"bf16 d128 per-key mask key runs", true, 2, 2, 2, 1000, 4097, 128, false, -1, -1, per_key, 0.4f, per_key, false, 0, 0, -1, 2},
      {"fp16 d64 per-key mask key runs causal", false, 2, 2, 2, 4097, 4097, 64, true, -1, -1, per_key, 0.1f, none, false, 0, 0, -1, 2},
      {"bf16 d128 (1,1,1,Sk) mask runs 17", true, 1, 2, 2, 17, 1000, 128, false, -1, -1, qk_only, 0.5f, none, false, 0, 0, -1, 2},
      {"bf16 d64 mask runs window", true, 1, 2, 2, 1000, 1000, 64, false, 256, 16, full, 0.5f, none, false, 0, 0, -1, 2},
  };
  int fails = 0;
  const bool time_only = argc > 1 && std::string(argv[1]) == "--time-only";
  if (time_only && argc > 2) g_time_filter = argv[2];  // --time-only "D=64|bias"
  if (!time_only)
  for (const Cfg& c : cfgs) fails += run_cfg(c, rng);
  // unsupported head dim must throw kValue
  {
    ForwardParams p; p.dtype = DType::kBFloat16; p.head_dim = 264; p.batch = 1; p.seqlen_q = 1; p.seqlen_k = 1; p.num_heads = 1; p.num_heads_kv = 1;
    try { cuda::forward(p); printf("head_dim 264: no error FAIL\n"); ++fails; }
    catch (const Error& e) { printf("head_dim 264 -> %s (kind %d)\n", e.what(), (int)e.kind()); }
  }
  printf("%d config(s) failed\n", fails);
  if (argc > 1 && std::string(argv[1]) == "--no-time") return fails ? 1 : 0;
  time_cfg("bf16 B=2 H=16 S=8192 D=128 non-causal", 2, 16, 8192, 128, false, 0);
  time_cfg("bf16 B=2 H=16 S=8192 D=128 causal", 2, 16, 8192, 128, true, 0);
  time_cfg("bf16 B=2 H=16 S=8192 D=128 dense bias", 2, 16, 8192, 128, false, 1);
  time_cfg("bf16 B=2 H=16 S=8192 D=128 dense bias causal", 2, 16, 8192, 128, true, 1);
  time_cfg("bf16 B=2 H=16 S=8192 D=128 Doge per-key bias+mask(2048) causal", 2, 16, 8192, 128, true, 2, 1);
  time_cfg("bf16 B=2 H=16 S=8192 D=128 Doge per-key bias+mask(2048)", 2, 16, 8192, 128, false, 2, 1);
  time_cfg("bf16 B=2 H=16 S=8192 D=128 full mask 1/4 tiles (skip)", 2, 16, 8192, 128, false, 0, 2);
  time_cfg("bf16 B=8 H=16 S=2048 D=64 non-causal", 8, 16, 2048, 64, false, 0);
  time_cfg("bf16 B=2 H=16 S=8192 D=64 non-causal", 2, 16, 8192, 64, false, 0);
  time_cfg("bf16 B=2 H=16 S=8192 D=256 non-causal", 2, 16, 8192, 256, false, 0);
  return fails ? 1 : 0;
}
