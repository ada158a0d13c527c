#pragma once

// Typed host views of a Forward's bytes (server/data_plane.h HostForward)
// for the transports that read their inputs from host memory: the Gloo
// plane computes on them and the one-sided plane uploads them. In place
// where the bytes are aligned for their element type (the common case:
// protobuf's strings and the caller's spans are), otherwise decoded into
// copies; an fp32 hidden is rounded to nearest-even bf16 (core/bf16.h).
// The output is written in place when aligned, otherwise into a staging
// copy that Finish() writes back. Source: issue 11 item 2 (one copy each
// way on the Forward RPC's path), issue 34 item 1 (one Forward entry per
// transport). Not thread-safe; views are valid while `io` is.

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/ep_contract.h"
#include "server/data_plane.h"

namespace moe_ep::server {

class HostForwardTensors {
 public:
  // REQUIRES: each of `io`'s byte views holds whole elements (DataPlane's
  // Forward and ForwardBytes check that before RunForward).
  explicit HostForwardTensors(const HostForward& io);
  HostForwardTensors(const HostForwardTensors&) = delete;
  HostForwardTensors& operator=(const HostForwardTensors&) = delete;

  absl::Span<const core::bf16_t> hidden() const { return hidden_; }       // [T, H]
  absl::Span<const int32_t> topk_ids() const { return topk_ids_; }        // [T, K]
  absl::Span<const float> topk_weights() const { return topk_weights_; }  // [T, K]
  absl::Span<core::bf16_t> output() { return output_; }                   // [T, H]
  // Writes a staged output back into the HostForward's output bytes (no-op
  // when it was written in place). Call once the step succeeded.
  void Finish();

 private:
  absl::Span<char> out_bytes_;
  std::vector<core::bf16_t> hidden_copy_;
  std::vector<int32_t> ids_copy_;
  std::vector<float> weights_copy_;
  std::vector<core::bf16_t> output_copy_;
  absl::Span<const core::bf16_t> hidden_;
  absl::Span<const int32_t> topk_ids_;
  absl::Span<const float> topk_weights_;
  absl::Span<core::bf16_t> output_;
};

// RunOnHostTensors()
//
// A transport's RunForward over typed host views: `step` gets hidden [T, H]
// bf16, topk_ids [T, K] int32, topk_weights [T, K] fp32 and output [T, H]
// bf16 (HostForwardTensors of `io`); a staged output is written back once
// it succeeds. Returns `step`'s result.
using HostStep = std::function<absl::StatusOr<core::StepStats>(
    absl::Span<const core::bf16_t> hidden, absl::Span<const int32_t> topk_ids,
    absl::Span<const float> topk_weights, absl::Span<core::bf16_t> output)>;
absl::StatusOr<core::StepStats> RunOnHostTensors(const HostForward& io, const HostStep& step);

}  // namespace moe_ep::server
