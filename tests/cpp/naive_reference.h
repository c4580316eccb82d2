// Naive float64 reference of the attention contract (docs/semantics.md): for each
// (batch, head, query) it materializes the full score row and applies the spec formulas
// directly. Besides each result it returns a "magnitude" -- the same sum taken over absolute
// values, with each softmax weight widened by the error a rounded score would cause -- which
// bounds the rounding error of any summation order and is what the tests scale tolerances by.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace dmattn::test {

// A mask or bias in the reference: values (row-major over its own shape) and the shape
// right-aligned to 4 dims (B, H or Hkv or 1, Sq or 1, Sk or 1).
struct RefOperand {
  bool present = false;
  std::vector<double> values;
  int64_t size[4] = {1, 1, 1, 1};

  int64_t index(int64_t b, int64_t h, int64_t i, int64_t j, int64_t heads) const {
    const int64_t bb = size[0] == 1 ? 0 : b;
    // Head dim holds H entries, Hkv entries (one per GQA group) or 1.
    const int64_t hh = size[1] == 1 ? 0 : (size[1] == heads ? h : h / (heads / size[1]));
    const int64_t ii = size[2] == 1 ? 0 : i;
    const int64_t jj = size[3] == 1 ? 0 : j;
    return ((bb * size[1] + hh) * size[2] + ii) * size[3] + jj;
  }
};

struct RefProblem {
  int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, dim;
  double scale, softcap;
  int64_t window_left, window_right;  // already normalized: causal => right = 0
  std::vector<double> q, k, v, dout;  // row-major (B, S, heads, D)
  RefOperand mask, bias;
};

struct RefResult {
  std::vector<double> out, lse, dq, dk, dv, dbias;
  std::vector<double> out_mag, lse_mag, dq_mag, dk_mag, dv_mag, dbias_mag;
};

inline RefResult naive_attention_reference(const RefProblem& pr) {
  const int64_t B = pr.batch, Sq = pr.seqlen_q, Sk = pr.seqlen_k, H = pr.heads,
                Hkv = pr.heads_kv, D = pr.dim, G = H / Hkv;
  const double inf = std::numeric_limits<double>::infinity();
  auto qi = [&](int64_t b, int64_t i, int64_t h) { return ((b * Sq + i) * H + h) * D; };
  auto kj = [&](int64_t b, int64_t j, int64_t hk) { return ((b * Sk + j) * Hkv + hk) * D; };

  RefResult r;
  r.out.assign(B * Sq * H * D, 0), r.out_mag.assign(B * Sq * H * D, 0);
  r.dq.assign(B * Sq * H * D, 0), r.dq_mag.assign(B * Sq * H * D, 0);
  r.lse.assign(B * H * Sq, -inf), r.lse_mag.assign(B * H * Sq, 0);
  r.dk.assign(B * Sk * Hkv * D, 0), r.dk_mag.assign(B * Sk * Hkv * D, 0);
  r.dv.assign(B * Sk * Hkv * D, 0), r.dv_mag.assign(B * Sk * Hkv * D, 0);
  if (pr.bias.present) {
    r.dbias.assign(pr.bias.values.size(), 0), r.dbias_mag.assign(pr.bias.values.size(), 0);
  }

  std::vector<double> s(Sk), s_mag(Sk), cap_grad(Sk), p(Sk), w(Sk), dp(Sk), dp_mag(Sk);
  std::vector<char> allowed(Sk);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < Sq; ++i) {
        const double* q = &pr.q[qi(b, i, h)];
        const double* dout = &pr.dout[qi(b, i, h)];
        // Scores.
        double row_max = -inf;
        for (int64_t j = 0; j < Sk; ++j) {
          const double* k = &pr.k[kj(b, j, hk)];
          double dot = 0, dot_mag = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d], dot_mag += std::fabs(q[d] * k[d]);
          double x = pr.scale * dot;
          cap_grad[j] = 1;
          if (pr.softcap > 0) {
            const double y = x / pr.softcap;
            x = pr.softcap * std::tanh(y);
            cap_grad[j] = 1 / (std::cosh(y) * std::cosh(y));  // 1 - tanh^2 without cancellation
          }
          const int64_t off = Sk - Sq;
          bool ok = (pr.window_left < 0 || j >= i + off - pr.window_left) &&
                    (pr.window_right < 0 || j <= i + off + pr.window_right);
          if (pr.mask.present) ok = ok && pr.mask.values[pr.mask.index(b, h, i, j, H)] != 0;
          double bias = 0;
          if (pr.bias.present) bias = pr.bias.values[pr.bias.index(b, h, i, j, H)];
          ok = ok && bias != -inf;
          allowed[j] = ok;
          s[j] = ok ? x + bias : -inf;
          s_mag[j] = pr.scale * dot_mag + std::fabs(bias);
          if (ok) row_max = std::max(row_max, s[j]);
        }
        if (row_max == -inf) continue;  // empty row: out 0, lse -inf, no gradient
        double sum = 0;
        for (int64_t j = 0; j < Sk; ++j) sum += allowed[j] ? std::exp(s[j] - row_max) : 0.0;
        const double lse = row_max + std::log(sum);
        r.lse[(b * H + h) * Sq + i] = lse;
        double score_err = 0;  // softmax-weighted score magnitude: how far lse can drift
        for (int64_t j = 0; j < Sk; ++j) {
          // Not exp(s - lse): with a huge |max| (a bias of finfo.min), lse rounds to max.
          p[j] = allowed[j] ? std::exp(s[j] - row_max) / sum : 0.0;
          if (p[j] > 0) score_err += p[j] * s_mag[j];  // s_mag is inf at -inf biases
        }
        r.lse_mag[(b * H + h) * Sq + i] = 1 + std::fabs(lse) + score_err;
        // A rounded score s(1+e) changes p by p * (s_mag e + lse drift).
        for (int64_t j = 0; j < Sk; ++j) {
          w[j] = p[j] == 0 ? 0.0 : p[j] * (1 + s_mag[j] + score_err);  // no 0 * inf
        }

        double* out = &r.out[qi(b, i, h)];
        double* out_mag = &r.out_mag[qi(b, i, h)];
        for (int64_t j = 0; j < Sk; ++j) {
          if (!allowed[j]) continue;
          const double* v = &pr.v[kj(b, j, hk)];
          for (int64_t d = 0; d < D; ++d) {
            out[d] += p[j] * v[d];
            out_mag[d] += w[j] * std::fabs(v[d]);
          }
        }

        // Backward.
        double delta = 0, delta_mag = 0;
        for (int64_t j = 0; j < Sk; ++j) {
          dp[j] = dp_mag[j] = 0;
          if (!allowed[j]) continue;
          const double* v = &pr.v[kj(b, j, hk)];
          for (int64_t d = 0; d < D; ++d) {
            dp[j] += dout[d] * v[d];
            dp_mag[j] += std::fabs(dout[d] * v[d]);
          }
          delta += p[j] * dp[j];
          delta_mag += w[j] * dp_mag[j];
        }
        for (int64_t j = 0; j < Sk; ++j) {
          if (!allowed[j]) continue;
          const double ds = p[j] * (dp[j] - delta);
          const double ds_mag = w[j] * (dp_mag[j] + delta_mag);
          if (pr.bias.present) {
            const int64_t e = pr.bias.index(b, h, i, j, H);
            r.dbias[e] += ds;
            r.dbias_mag[e] += ds_mag;
          }
          // An implementation computing 1 - tanh^2 in its accumulator type has an absolute
          // error of a few ulps of 1 in the derivative, hence the "+ 1" in its magnitude.
          const double cap_grad_mag = pr.softcap > 0 ? cap_grad[j] + 1 : 1;
          const double g = pr.scale * ds * cap_grad[j], g_mag = pr.scale * ds_mag * cap_grad_mag;
          const double* k = &pr.k[kj(b, j, hk)];
          double* dq = &r.dq[qi(b, i, h)];
          double* dq_mag = &r.dq_mag[qi(b, i, h)];
          double* dk = &r.dk[kj(b, j, hk)];
          double* dk_mag = &r.dk_mag[kj(b, j, hk)];
          double* dv = &r.dv[kj(b, j, hk)];
          double* dv_mag = &r.dv_mag[kj(b, j, hk)];
          for (int64_t d = 0; d < D; ++d) {
            dq[d] += g * k[d], dq_mag[d] += g_mag * std::fabs(k[d]);
            dk[d] += g * q[d], dk_mag[d] += g_mag * std::fabs(q[d]);
            dv[d] += p[j] * dout[d], dv_mag[d] += w[j] * std::fabs(dout[d]);
          }
        }
      }
    }
  }
  return r;
}

}  // namespace dmattn::test
