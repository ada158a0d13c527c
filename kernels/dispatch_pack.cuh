#pragma once

// Host launcher that packs this rank's tokens into the dispatch send buffer
// and sanitizes its padding slots (DESIGN §5, §7).
//
// Send buffer layout, per step with R = runtime_max_tokens_per_rank:
//   send [E, R, dispatch_bytes], dispatch_bytes = 2H + 8K, one row =
//   hidden [H] bf16 | ids [K] int32 | weights [K] fp32.
// Slab d (rows d*R .. d*R + R - 1) goes to rank d: rows [0, send_counts[d])
// hold the tokens routed to d in increasing token order, rows
// [send_counts[d], R) are padding with every id = invalid_expert_id and every
// weight 0 (their hidden bytes are left as they are and never read).
// With dtype kFP8E4M3 a row is the fp8 wire row of kernels/fp8_dispatch.cuh
// (codes [H] | scales [H / 128] fp32 | ids | weights, H + H/32 + 8K bytes):
// the pack quantizes each token once, per 128-value block, with
// core/fp8_e4m3.h's functions.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/workspace.h"
#include "kernels/route.cuh"

namespace moe_ep::kernels {

// Bytes of one dispatch row: 2H + 8K (bf16 hidden, int32 ids, fp32 weights).
constexpr int64_t DispatchRowBytes(int64_t hidden, int top_k) { return 2 * hidden + 8 * top_k; }

struct PackDispatchParams {
  const uint16_t* hidden = nullptr;      // device [R, H] bf16, rows [0, T) read
  const int32_t* topk_ids = nullptr;     // device [R, K]
  const float* topk_weights = nullptr;   // device [R, K]
  const int32_t* token_slot = nullptr;   // device [R, E] from LaunchRoute
  const int32_t* send_counts = nullptr;  // device [E] from LaunchRoute
  const int64_t* num_tokens = nullptr;   // device scalar T, clamped to max_tokens
  int64_t max_tokens = 0;                // R
  int64_t hidden_size = 0;               // H, a multiple of 4
  int top_k = 0;                         // K
  int ep_size = 0;                       // E
  int32_t invalid_expert_id = -1;        // written into padding slots
  uint8_t* send = nullptr;               // device [E, R, 2H + 8K], 8-byte aligned
  // The route's placement table (null offsets: contiguous, ids as given).
  // Under a table, a choice of an expert with several replicas is written
  // as invalid_expert_id into the copies for ranks that do not serve it
  // (core::PayloadExpertId).
  DevicePlacement placement;
  int num_experts = 0;  // >= ep_size; ids outside [0, num_experts) travel as invalid_expert_id
  // kBF16 (rows of DispatchRowBytes) or kFP8E4M3 (Fp8DispatchRowBytes; H a
  // multiple of 128, send 4-byte aligned).
  core::DispatchDType dtype = core::DispatchDType::kBF16;
};

// LaunchPackDispatch()
//
// Enqueues the pack on `stream`. Grid: R blocks of 256 threads; block b copies
// token b (when b < T) to each of its destinations in 8-byte vectors, reading
// the hidden row once, and sanitizes padding slot b of every destination d
// with send_counts[d] <= b. A token's rows and the padding rows are disjoint,
// so no two blocks write the same bytes.
//
// fp8: the same grid; each warp of a block quantizes 128-value blocks of the
// token (kernels::internal::QuantizeWarpBlock) and stores codes and scale
// into each destination row.
// Errors (host checks, nothing enqueued):
//   kInvalidArgument  null pointers, max_tokens < 0, H < 4 or not a multiple
//                     of 4 (fp8: of 128), K or E out of range, num_experts
//                     < E, send not
//                     8-byte aligned, a dtype other than bf16 / fp8_e4m3.
//   kInternal         the launch failed.
// Never allocates or synchronises (graph-capturable).
absl::Status LaunchPackDispatch(const PackDispatchParams& params, cudaStream_t stream);

}  // namespace moe_ep::kernels
