// Running (online) softmax statistics of one query row, shared by the forward pass and the
// backward's statistics pass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/vector_math.h"

namespace dmattn::cpu {

template <typename Acc>
struct OnlineSoftmaxRow {
  static constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
  Acc max = kNegInf;  // running max over allowed scores; -inf while none was seen, NaN once
                      // a NaN score was seen
  Acc sum = 0;        // sum of exp(score - max) over allowed scores

  // No allowed key (a NaN score is not "nothing": it makes max, sum, out and lse NaN).
  bool empty() const { return max == kNegInf; }

  // Folds one block of scores (disallowed = -inf) into the statistics and turns the block into
  // exp(score - new max) in place (0 where disallowed). Returns the factor by which anything
  // accumulated with the old max must be rescaled: exp(old max - new max), 0 before the first
  // allowed key, 1 if the max did not move. exp never sees -inf - (-inf). A NaN score makes
  // the max NaN, and with it the whole block, the sum and the rescale factor: NaN in, NaN out.
  Acc update(Acc* scores, int64_t cols) {
    const Acc new_max = max_keep_nan(max, row_max(scores, cols));
    if (new_max == kNegInf) {  // nothing allowed so far
      std::fill(scores, scores + cols, Acc(0));
      return Acc(1);
    }
    exp_shifted(scores, cols, new_max);  // -inf -> 0 (new_max is finite or NaN)
    const Acc block_sum = row_dot(scores, static_cast<const Acc*>(nullptr), cols);
    const Acc rescale = max == new_max ? Acc(1) : (empty() ? Acc(0) : std::exp(max - new_max));
    sum = sum * rescale + block_sum;
    max = new_max;
    return rescale;
  }
};

}  // namespace dmattn::cpu
