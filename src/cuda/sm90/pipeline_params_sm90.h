// Parameters of the CUTLASS pipelines that connect the producer warpgroup and the consumers of the
// warp-specialized Hopper kernels: TMA pipelines (the producer's one thread issues, transaction
// bytes complete a stage) and loader pipelines (a producer warp's plain stores, each lane arrives).
#pragma once

#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace dmattn::cuda::sm90 {

template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(int transaction_bytes, bool producer,
                                                                         int consumer_threads) {
  typename Pipeline::Params p;
  p.transaction_bytes = transaction_bytes;
  p.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  p.is_leader = threadIdx.x == 0;
  p.num_consumers = consumer_threads;
  return p;
}

// A TMA pipeline whose stages `producers` threads fill by cp.async instead: each arrives once its
// copies land (cpasync_barrier_arrive_noinc); none expects transaction bytes.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params cp_async_pipeline_params(bool producer, int consumer_threads,
                                                                             int producers) {
  typename Pipeline::Params p;
  p.transaction_bytes = 0;
  p.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  p.is_leader = 0;
  p.num_consumers = consumer_threads;
  p.num_producers = producers;
  return p;
}

// The state of a pipeline of kStages stages after `count` steps, for its consumers or (producer:
// the first pass finds every stage empty) its producer.
template <int kStages>
__device__ __forceinline__ cutlass::PipelineState<kStages> pipeline_state_at(uint32_t count, bool producer) {
  return {int(count % kStages), ((count / kStages) & 1) ^ uint32_t(producer), count};
}

// A one-stage pipeline's state at its t-th use, derived from t rather than held across a loop
// (a held state takes registers): the consumer's phase flips with every use from 0, the
// producer's from 1 (as make_producer_start_state begins).
__device__ __forceinline__ cutlass::PipelineState<1> one_stage_consumer_state(int t) {
  return cutlass::PipelineState<1>(0, t & 1, t);
}
__device__ __forceinline__ cutlass::PipelineState<1> one_stage_producer_state(int t) {
  return cutlass::PipelineState<1>(0, (t & 1) ^ 1, t);
}

// (one loader warp: its 32 lanes arrive)
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params loader_pipeline_params(bool producer, int consumer_threads) {
  typename Pipeline::Params p;
  p.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  p.producer_arv_count = 32;
  p.consumer_arv_count = consumer_threads;
  return p;
}

}  // namespace dmattn::cuda::sm90
