#pragma once

// The shared expert of a LoadExperts request (proto moe_ep.v1.SharedExpert;
// DESIGN §7; issue 18): argument checks, the memory cap, and making the
// replica from a checkpoint or the seeded generator. Kept apart from
// server/worker_service.cc so the service only calls it.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "core/shared_expert.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::server {

// MakeSharedExpert()
//
// nullopt when `request` has no shared_expert. Otherwise the layer's shared
// expert for hidden size `hidden`: identity when request.kind is IDENTITY
// (gated by the seeded gate with sigmoid_gate), else a SwiGLU of
// shared_expert.intermediate_size from `checkpoint_path` (the canonical
// path server/path_policy.h resolved request.safetensors_path to; the
// request's own path is never opened, so a link swapped after the check
// cannot redirect the read) with shared_expert.name_pattern (and gate_name
// with sigmoid_gate), or seeded from request.seed when the request names no
// checkpoint. `held_bytes` is what the worker holds once the request
// is applied without any shared expert for the layer (workspace and every
// routed and other shared expert), `memory_cap_bytes` its cap (0 = none).
// Errors: kInvalidArgument naming the field (intermediate_size < 1 for
// SWIGLU or too large, name_pattern or gate_name missing with a
// checkpoint), kResourceExhausted (held + the replica beyond the cap, with
// the numbers), and those of core::SharedExpert::LoadSafetensors.
// Thread-safe (pure apart from reading the checkpoint).
absl::StatusOr<std::optional<core::SharedExpert>> MakeSharedExpert(
    const v1::LoadExpertsRequest& request, const std::string& checkpoint_path, int64_t hidden,
    int64_t held_bytes, int64_t memory_cap_bytes);

}  // namespace moe_ep::server
