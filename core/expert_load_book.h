#pragma once

// The load statistics a data plane keeps per MoE layer (DESIGN §15; issue 17
// item 2): each step's tokens per logical expert (drained from the
// dispatcher's host or device counters after the step) added to the layer's
// window, which GetExpertLoad reads and may reset, and to the layer's
// totals since AllocateWorkspace, which never reset (the monotonic
// moe_ep_expert_tokens_total counter of /metrics). Both data planes hold
// one. Not thread-safe (its data plane's owner serializes the calls).

#include <cstdint>
#include <map>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/ep_dispatcher.h"

namespace moe_ep::core {

// Which step a drained count belongs to: its geometry epoch, the rank mask
// round it ran under, and its routing (RoutingFingerprint of this rank's
// topk_ids). A step whose Forward failed on some ranks after it finished on
// others is sent again to the live ranks, under a later mask round, with
// the same epoch and the same inputs: a rank that had finished it counts it
// once (issue 17). The epoch and the round alone cannot tell that resend
// from the next step (many steps share an epoch, and the first step after
// a mask comes under the later round too), and no sequence the ranks keep
// can: the survivors cannot tell whether the lost rank finished the last
// step (the client then sends the next one) or not (it resends this one),
// and a ForwardRequest carries no step number. What a resend repeats is its
// routing, so a step with other routing always adds; one with exactly the
// routing of the step before the mask (an idle rank's empty steps, or a
// client repeating a step's inputs) is taken for its resend.
struct LoadStepKey {
  int64_t epoch = -1;  // < 0: not a step of a geometry (always added)
  int mask_round = 0;
  uint64_t routing = 0;  // RoutingFingerprint of the step's topk_ids
};

// RoutingFingerprint()
//
// A 64-bit hash of a step's topk_ids bytes ([T, K] int32, little-endian as
// they came; any alignment), length included. Equal for equal bytes within
// this process (absl::Hash: not stable across processes, and never needs
// to be). Pure and thread-safe.
uint64_t RoutingFingerprint(absl::string_view topk_ids);
// The same of host int32 ids ([T, K]).
uint64_t RoutingFingerprint(absl::Span<const int32_t> topk_ids);

class ExpertLoadBook {
 public:
  // Forgets every layer; later layers have `num_experts` counters.
  void Reset(int num_experts);

  // Adds one drained step (or several) of `layer`: step.tokens_per_expert
  // must have num_experts entries (shorter ones add what they have). When
  // `key` has the epoch and the routing of the layer's last added step and
  // a later mask round (that step resent after a mask), that step's counts
  // are replaced by these: the step counts once, in the window (unless it
  // was reset since) and in the totals. Any other key adds.
  void Add(int layer, const ExpertLoadCounts& step, LoadStepKey key = {});

  // The layer's window (zeros and 0 steps for a layer with none); with
  // `reset`, the window starts again from zero. Totals are unaffected.
  ExpertLoadCounts Read(int layer, bool reset);

  // Tokens per logical expert of `layer` since Reset ([num_experts]; zeros
  // for a layer with no step).
  std::vector<int64_t> Totals(int layer) const;

 private:
  struct Layer {
    ExpertLoadCounts window;
    std::vector<int64_t> totals;
    LoadStepKey last_key;              // of the last Add
    std::vector<int64_t> last_counts;  // what it added
    int64_t last_steps = 0;
    bool last_in_window = false;  // not reset since
  };
  int num_experts_ = 0;
  std::map<int, Layer> layers_;
};

}  // namespace moe_ep::core
