// Where the backward keeps the probabilities P and their gradients dS of the tiles it has
// computed, so that each (query block, key block) tile is multiplied out once per pass rather
// than once per use (the recomputation of S = Q K^T and dP = dO V^T is most of the cost).
//
// Two levels, each used when it fits its memory limit (set_backward_cache_limits):
//  - TileStore: every tile of the problem, (batch, head, query block, key block). The query
//    pass fills it; the key pass (dK, dV, dbias) then reads P and dS instead of recomputing
//    them. Tiles that causal / window skip are never written or read.
//  - RowTiles: per thread, the tiles of one query block (every key block it reaches), so that
//    the query pass computes S and dP once for both the softmax statistics and dQ.
// Without either, the backward recomputes everything (three passes, bounded memory).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/tile_math.h"

namespace dmattn::cpu {

// Bytes of cached tiles the backward may hold (cpu_backward.cpp).
struct BackwardCacheLimits {
  int64_t store_bytes;  // TileStore, for the whole call
  int64_t row_bytes;    // RowTiles, per thread
};
BackwardCacheLimits backward_cache_limits();

// One cached tile: P, dS (dP until the query pass turns it into dS) and, with softcap, its
// derivative; each kBlockQ x kBlockK with leading dimension kBlockK.
template <typename Acc>
struct TilePointers {
  Acc* probs;
  Acc* dprobs;
  Acc* cap_grad;  // null without softcap
};

constexpr int64_t kTileElements = kBlockQ * kBlockK;

// The tile store's memory outlives a call: the next backward takes it back instead of faulting
// in fresh pages (allocations this large are mmap-ed and unmapped on free; the page faults
// cost about a tenth of a backward at S = 1024). One buffer per accumulator type is kept.
template <typename Acc>
class SpareBuffer {
 public:
  static std::unique_ptr<Acc[]> take(int64_t elements) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (buffer_ && size_ >= elements) return std::move(buffer_);
    return std::unique_ptr<Acc[]>(new Acc[elements]);  // not value-initialized
  }
  static void give_back(std::unique_ptr<Acc[]> buffer, int64_t elements) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!buffer_ || size_ < elements) buffer_ = std::move(buffer), size_ = elements;
  }

 private:
  static inline std::mutex mutex_;
  static inline std::unique_ptr<Acc[]> buffer_;
  static inline int64_t size_ = 0;
};

template <typename Acc>
class TileStore {
 public:
  // Empty (enabled() false) when the tiles would exceed `limit_bytes`.
  TileStore(int64_t batch, int64_t heads, int64_t query_blocks, int64_t key_blocks,
            int64_t limit_bytes)
      : heads_(heads), query_blocks_(query_blocks), key_blocks_(key_blocks) {
    const int64_t tiles = batch * heads * query_blocks * key_blocks;
    if (tiles == 0 || tiles * kTileElements * 2 * int64_t{sizeof(Acc)} > limit_bytes) return;
    // Uninitialized: only the tiles the query pass reaches are ever written or read.
    elements_ = tiles * kTileElements * 2;  // P, then dS
    data_ = SpareBuffer<Acc>::take(elements_);
    dprobs_offset_ = tiles * kTileElements;
    computed_.assign(static_cast<size_t>(tiles), 0);
  }
  ~TileStore() {
    if (data_) SpareBuffer<Acc>::give_back(std::move(data_), elements_);
  }
  TileStore(const TileStore&) = delete;
  TileStore& operator=(const TileStore&) = delete;

  bool enabled() const { return data_ != nullptr; }

  TilePointers<Acc> tile(int64_t b, int64_t h, int64_t query_block, int64_t key_block) const {
    Acc* probs = data_.get() + index(b, h, query_block, key_block) * kTileElements;
    return {probs, probs + dprobs_offset_, nullptr};
  }
  // Set by the query pass for each tile it filled; a tile never filled is all zeros (no query
  // of its block reaches any of its keys).
  void mark_computed(int64_t b, int64_t h, int64_t query_block, int64_t key_block) {
    computed_[static_cast<size_t>(index(b, h, query_block, key_block))] = 1;
  }
  bool computed(int64_t b, int64_t h, int64_t query_block, int64_t key_block) const {
    return computed_[static_cast<size_t>(index(b, h, query_block, key_block))] != 0;
  }

 private:
  int64_t index(int64_t b, int64_t h, int64_t query_block, int64_t key_block) const {
    return ((b * heads_ + h) * query_blocks_ + query_block) * key_blocks_ + key_block;
  }

  int64_t heads_, query_blocks_, key_blocks_;
  int64_t elements_ = 0, dprobs_offset_ = 0;
  std::unique_ptr<Acc[]> data_;
  std::vector<uint8_t> computed_;  // one byte per tile: written by one task each
};

// Per-thread tiles of one query block, indexed by key block.
template <typename Acc>
class RowTiles {
 public:
  RowTiles(int64_t key_blocks, bool softcap)
      : probs_(key_blocks * kTileElements), dprobs_(key_blocks * kTileElements),
        cap_grad_(softcap ? key_blocks * kTileElements : 0) {}

  static int64_t bytes(int64_t key_blocks, bool softcap) {
    return key_blocks * kTileElements * (softcap ? 3 : 2) * int64_t{sizeof(Acc)};
  }

  TilePointers<Acc> tile(int64_t key_block) {
    const int64_t e = key_block * kTileElements;
    return {probs_.data() + e, dprobs_.data() + e,
            cap_grad_.empty() ? nullptr : cap_grad_.data() + e};
  }

 private:
  std::vector<Acc> probs_, dprobs_, cap_grad_;
};

}  // namespace dmattn::cpu
