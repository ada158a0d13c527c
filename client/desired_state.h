#pragma once

// The desired state of `moe-ep coordinator` (proto moe_ep.v1.DesiredState,
// DESIGN §16, issue 12 item 5): reading it from a file, filling its defaults,
// validating it, and turning it into the worker requests that make a group
// match it.

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/placement_table.h"
#include "moe_ep/v1/coordinator.pb.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::client {

namespace v1 = ::moe_ep::v1;

// Defaults of the fields left 0 / empty (the main job's default run,
// client/run_job.h: qwen3-30b-a3b, 3 layers, at most 384 tokens per rank).
inline constexpr const char* kDefaultStateBackend = "gloo";
inline constexpr const char* kDefaultStateModel = "qwen3-30b-a3b";
inline constexpr int kDefaultStateLayers = 3;
inline constexpr int64_t kDefaultStateCapacityTokens = 384;
inline constexpr int64_t kDefaultStateGroupTimeoutMs = 30000;
inline constexpr int64_t kDefaultStateRpcTimeoutMs = 120000;

// ParseDesiredStateJson()
//
// Parses the proto3 JSON form of DesiredState (field names as in the .proto
// or lowerCamelCase). Enums by name, either the proto's
// ("EXPERT_KIND_SWIGLU", "DISPATCH_DTYPE_FP8_E4M3") or, as the CLI spells
// them, without the enum's prefix in any case ("swiglu", "fp8_e4m3"; issue
// 31 item 7). Errors: kInvalidArgument with the parser's message (unknown
// field, wrong type, an enum value that is neither).
absl::StatusOr<v1::DesiredState> ParseDesiredStateJson(absl::string_view json);

// An example desired state in the file form (two Gloo workers on loopback,
// the qwen3-30b-a3b preset, 2 layers of seeded SwiGLU experts), which
// ParseDesiredStateJson and ValidateDesiredState accept
// (tests/client/desired_state_test.cc).
std::string ExampleDesiredStateJson();

// The end of `moe-ep coordinator --help`: what --state reads (the fields,
// their defaults, the enum spellings) and ExampleDesiredStateJson().
std::string DesiredStateHelp();

// Reads and parses `path`. Errors: kNotFound when it cannot be read (names
// the path); ParseDesiredStateJson's, prefixed with the path.
absl::StatusOr<v1::DesiredState> ReadDesiredStateFile(const std::string& path);

// `state` with every 0 / empty default field set to its default (above;
// procs_per_pod 1, pod_prefix the first label of the service name, expert
// kind SWIGLU, dtype BF16). Two states are the same desired state when their
// WithDefaults() are equal (SameDesiredState).
v1::DesiredState WithDefaults(const v1::DesiredState& state);
bool SameDesiredState(const v1::DesiredState& a, const v1::DesiredState& b);

// ValidateDesiredState()
//
// Checks `state` by itself (before defaults are filled).
// Errors: kInvalidArgument naming the field: neither or both of targets and
// headless_service; a malformed or repeated target; headless_service with an
// empty service, replicas < 1, a port outside 1..65535, procs_per_pod < 0 or
// port_step < 0; backend not gloo / nccl / auto; layers, capacity_tokens,
// group_timeout_ms, rpc_timeout_ms or redundant_slots_per_rank < 0;
// redundant slots without a placement; the model unknown or unreadable
// (ResolveModel's message); layers above the model's sparse layers. The
// placement's own checks need the world size: DesiredPlacement.
// Pure apart from reading a model file; thread-safe.
absl::Status ValidateDesiredState(const v1::DesiredState& state);

// DesiredPlacement()
//
// The placement table of `state` (DESIGN §15) for a model of `num_experts`
// experts on `world` ranks: nullopt when state.placement is empty (the
// contiguous table). Errors: kInvalidArgument naming the field: placement
// not one entry per rank, a rank whose slot count is not ceil(num_experts /
// world) + redundant_slots_per_rank, or the table's own errors
// (core::PlacementTable::FromSlotExperts: an expert id out of range, an
// expert with no slot). Pure; thread-safe.
absl::StatusOr<std::optional<core::PlacementTable>> DesiredPlacement(const v1::DesiredState& state,
                                                                     int num_experts, int world);

// What a formation sends after Join, in this order.
struct GroupRequests {
  v1::ConfigureLayersRequest configure;
  v1::AllocateWorkspaceRequest allocate;
  // One per run layer (ascending) when the state has a placement, sent
  // after AllocateWorkspace and before LoadExperts; empty otherwise.
  std::vector<v1::InstallPlacementRequest> placements;
  std::vector<v1::LoadExpertsRequest> load;  // one per run layer, ascending
};

// BuildGroupRequests()
//
// The requests of the main job's layout (client/run_job.h) for `world`
// ranks: ConfigureLayers with tp = attn_dp = world, moe_dense_tp 1, a2a on
// and the model's description; AllocateWorkspace with the model's H, K and
// experts, capacity_tokens and dispatch_dtype; LoadExperts of the first
// `layers` sparse layers from the expert source (with the model's shared
// expert when it has one); with a placement, redundant_slots_per_rank in
// AllocateWorkspace and InstallPlacement of the table on every run layer.
// Errors: ValidateDesiredState's; kInvalidArgument when the model has fewer
// experts than `world` ranks; DesiredPlacement's.
absl::StatusOr<GroupRequests> BuildGroupRequests(const v1::DesiredState& state, int world);

}  // namespace moe_ep::client
