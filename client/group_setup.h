#pragma once

// `moe-ep up`'s configuration of a formed group (issue 16 item 3): one MoE
// model of --layers sparse layers of the given sizes (ConfigureLayers), the
// workspace (AllocateWorkspace) and, when asked, the experts of every layer
// (LoadExperts), so that embedded workers (server/moe_ep.h) become ready for
// their in-process data calls. Source: DESIGN §8, §14.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/coordinator.h"

namespace moe_ep::client {

struct GroupSetupOptions {
  int64_t hidden = 0;  // H; 0 = only form the group
  int num_experts = 0;
  int top_k = 0;
  int64_t capacity_tokens = 0;              // N per rank
  std::vector<int64_t> cuda_graph_buckets;  // ascending; empty = none
  int layers = 1;
  std::string experts = "none";  // none | identity | swiglu (seeded)
  int64_t intermediate = 0;      // I of swiglu experts
  uint64_t seed = 1;
  // The formed group's collective timeout (JoinRequest.timeout_ms), seconds
  // in (0, 3600]: how long a collective waits for every rank before the
  // group is broken (issue 30).
  double group_timeout_s = 120;
  // The padding id of topk ids (AllocateWorkspaceRequest.invalid_expert_id):
  // "-1" or "num_experts"; any other id outside [0, E) is an error (DESIGN §7).
  std::string invalid_expert_id = "-1";
  // What dispatch moves (AllocateWorkspaceRequest.dispatch_dtype): "bf16" or
  // "fp8_e4m3" (H a multiple of 128).
  std::string dispatch_dtype = "bf16";
};

// Checks without a worker: hidden 0 (nothing else given) or every size >= 1,
// top_k <= num_experts, num_experts >= `world` (when > 0), layers >= 1,
// experts one of none / identity / swiglu, intermediate >= 1 for swiglu,
// group_timeout_s in (0, 3600] (also when hidden is 0), invalid_expert_id
// "-1" or "num_experts", dispatch_dtype "bf16" or "fp8_e4m3".
// Errors: kInvalidArgument naming the flag (--hidden, --num-experts, --top-k,
// --capacity, --layers, --load-experts, --intermediate, --group-timeout,
// --invalid-expert-id, --dispatch-dtype) with expected and got.
absl::Status ValidateGroupSetup(const GroupSetupOptions& options, int world);

// ConfigureLayers, AllocateWorkspace and LoadExperts (each layer) on the
// formed group of `coordinator` (nothing when options.hidden is 0), with one
// summary line on `out`. Errors: ValidateGroupSetup's; worker errors
// aggregated per rank (client/coordinator.h).
absl::Status SetUpGroup(Coordinator& coordinator, const GroupSetupOptions& options,
                        std::ostream& out);

}  // namespace moe_ep::client
