#pragma once

// Bounds on every request-sized quantity of the moe_ep.v1.Worker service
// (issue 13 items 2, 6 and 7): a request may ask only for work and memory the
// worker's flags allow, so that no handler allocates or loops without bound.
// The limits are flags of moe-ep-worker (server/worker_flags.h, --max-*);
// their defaults fit every model config in ../shared/data with room to spare.
//
// Also here: the guard every handler runs in (no exception escapes a
// handler: std::bad_alloc and std::length_error become RESOURCE_EXHAUSTED)
// and the cap on error message lengths (a message longer than
// kMaxErrorMessageBytes is cut, so it never turns into RESOURCE_EXHAUSTED on
// the wire, whose default metadata limit is 8 KiB).
//
// Pure functions; thread-safe. Source: DESIGN §8; issue 13.

#include <cstdint>
#include <exception>
#include <functional>
#include <new>
#include <stdexcept>

#include "absl/status/status.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::server {

// Largest error message a handler returns, bytes (UTF-8 safe cut, then
// " ... (N bytes cut)").
inline constexpr size_t kMaxErrorMessageBytes = 2048;

struct RequestLimits {
  // Join.world_size: ranks of a group (a Gloo group opens ~2 sockets per peer).
  int32_t max_world_size = 1024;
  // Join.generation: a client picks 1 + the highest generation the workers
  // report, so the range never runs out (2^53: exact in JSON and Python
  // floats). A worker that saw this generation (or one above) accepts the
  // next one above it: the top of the range never locks Join out
  // (server/group_formation.h CheckJoin; issue 13 item 3).
  int64_t max_generation = int64_t{1} << 53;
  // Join.timeout_ms: the group's collective timeout.
  int64_t max_timeout_ms = 3600 * 1000;
  // top_k of AllocateWorkspace, Benchmark, ConfigureLayers, ForwardLayers.
  int32_t max_top_k = 64;
  // num_experts of the same RPCs.
  int32_t max_experts = 4096;
  // hidden_size (H) and moe_intermediate_size (I), elements.
  int64_t max_hidden = int64_t{1} << 16;
  // capacity_tokens, tokens_per_rank, Forward rows: tokens per rank.
  int64_t max_tokens = int64_t{1} << 20;
  // model.num_layers of ConfigureLayers.
  int32_t max_layers = 1024;
  // Benchmark.iterations and .warmup.
  int32_t max_iterations = 10000;
  // Benchmark routing work: tokens_per_rank * top_k * num_experts (the
  // sampler draws top_k experts per token out of num_experts).
  int64_t max_benchmark_draws = int64_t{1} << 30;
  // Largest checkpoint file LoadExperts opens, bytes.
  int64_t max_file_bytes = int64_t{1} << 40;
};

// Check*()
//
// OK when every size of the request is within `limits`, else
// INVALID_ARGUMENT naming the field, the limit and its flag
// ("top_k: expected <= 64 (--max-top-k), got 1024"). Only the bounds: the
// handlers check the rest (rank < world_size, top_k <= num_experts, ...).
absl::Status CheckJoin(const RequestLimits& limits, const v1::JoinRequest& request);
absl::Status CheckConfigureLayers(const RequestLimits& limits,
                                  const v1::ConfigureLayersRequest& request);
absl::Status CheckAllocateWorkspace(const RequestLimits& limits,
                                    const v1::AllocateWorkspaceRequest& request);
absl::Status CheckLoadExperts(const RequestLimits& limits, const v1::LoadExpertsRequest& request);
absl::Status CheckForward(const RequestLimits& limits, const v1::ForwardRequest& request);
absl::Status CheckBenchmark(const RequestLimits& limits, const v1::BenchmarkRequest& request);
absl::Status CheckForwardLayers(const RequestLimits& limits,
                                const v1::ForwardLayersRequest& request);

// CapMessage()
//
// `status` with its message cut to at most kMaxErrorMessageBytes (+ the note
// of how much was cut); OK and short messages unchanged.
absl::Status CapMessage(const absl::Status& status);

// RunGuarded()
//
// Runs `handler` and returns its status; an exception it throws becomes a
// status instead of terminating the process: std::bad_alloc and
// std::length_error (an allocation a request sized) RESOURCE_EXHAUSTED,
// anything else INTERNAL, each naming `rpc`.
absl::Status RunGuarded(const char* rpc, const std::function<absl::Status()>& handler);

}  // namespace moe_ep::server
