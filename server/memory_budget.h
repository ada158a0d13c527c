#pragma once

// The worker's memory budget (--memory-cap-bytes; DESIGN §5, §8; issue 10
// item 5, issue 13 item 2): the bytes the data plane's workspace and every
// layer's experts hold together, and the one check the four sizing RPCs make
// against the cap before they allocate (AllocateWorkspace, LoadExperts,
// Benchmark; ForwardLayers passes cap_bytes and held() to its runner).
// Messages name what needs the bytes, both numbers and the flag.
//
// Plain value type; pure functions; thread-safe.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe_ep::server {

struct MemoryBudget {
  int64_t cap_bytes = 0;        // the worker's cap; 0 = unlimited
  int64_t workspace_bytes = 0;  // the data plane's workspace (DataPlane::allocated_bytes)
  int64_t expert_bytes = 0;     // every layer's experts, shared ones included

  // Bytes held now: workspace + experts.
  int64_t held() const { return workspace_bytes + expert_bytes; }
  // The cap a call's own scratch gets (cap - held), as DataPlane::Benchmark
  // takes it: 0 (= unlimited) when the worker has no cap.
  int64_t ScratchCap() const { return cap_bytes > 0 ? cap_bytes - held() : 0; }
};

// CheckWorkspaceFits()
//
// AllocateWorkspace: a new workspace of `workspace_bytes` replaces the held
// one; `kept_expert_bytes` of experts stay with it (0 when the spec changes,
// which drops them). kResourceExhausted when their sum is above the cap:
// "AllocateWorkspace: the workspace needs W bytes (plus E of experts), more
// than the worker's memory cap of C bytes (--memory-cap-bytes)".
absl::Status CheckWorkspaceFits(const MemoryBudget& budget, int64_t workspace_bytes,
                                int64_t kept_expert_bytes);

// CheckExpertsFit()
//
// LoadExperts on `layer`: `new_bytes` of experts replace the layer's
// `old_bytes`. Returns the total the worker would hold (workspace + other
// layers' experts + new_bytes), or kResourceExhausted naming the layer, the
// workspace, the other layers' bytes and the cap when that is above the cap.
// REQUIRES: old_bytes <= budget.expert_bytes.
absl::StatusOr<int64_t> CheckExpertsFit(const MemoryBudget& budget, int layer, int64_t new_bytes,
                                        int64_t old_bytes);

// BenchmarkInputBytes()
//
// Host bytes of a Benchmark's inputs and outputs for `tokens` tokens:
// hidden in and out ([T, H] bf16 each) plus topk ids and weights ([T, K],
// 4 bytes each): T * (4 H + 8 K).
int64_t BenchmarkInputBytes(int64_t tokens, int64_t hidden, int top_k);

// CheckBenchmarkFits()
//
// Benchmark: its scratch workspace (`workspace_bytes`) and `input_bytes` on
// top of what is held. kResourceExhausted "Benchmark: needs N bytes
// (workspace and inputs) on top of H held, more than the memory cap of C
// bytes (--memory-cap-bytes)" when above the cap.
absl::Status CheckBenchmarkFits(const MemoryBudget& budget, int64_t workspace_bytes,
                                int64_t input_bytes);

// DeviceScratchCap()
//
// The cap a GPU plane passes to the scratch dispatcher of a call (Benchmark)
// once the call's own device buffers (`device_bytes`: inputs and output)
// are taken from `memory_cap_bytes`: 0 (= unlimited) when there is no cap.
// kResourceExhausted "Benchmark: inputs and output need N device bytes, more
// than the C bytes the memory cap leaves (--memory-cap-bytes)" when nothing
// is left. The same rule and message on both GPU planes (issue 34 item 1).
absl::StatusOr<int64_t> DeviceScratchCap(int64_t device_bytes, int64_t memory_cap_bytes);

}  // namespace moe_ep::server
