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

#include "core/ep_dispatcher.h"

namespace moe_ep::server {

// Which step a drained count belongs to: its geometry epoch and the rank
// mask round it ran under. A step whose Forward failed on some ranks after
// it finished on others is sent again, under the next mask round, with the
// same epoch: the ranks that had finished it count it once (issue 17).
struct LoadStepKey {
  int64_t epoch = -1;  // < 0: not a step of a geometry (always added)
  int mask_round = 0;
};

class ExpertLoadBook {
 public:
  // Forgets every layer; later layers have `num_experts` counters.
  void Reset(int num_experts);

  // Adds one drained step (or several) of `layer`: step.tokens_per_expert
  // must have num_experts entries (shorter ones add what they have). When
  // `key` has the epoch of the layer's last added step and a later mask
  // round (the step resent after a mask), that step's counts are replaced
  // by these (the routing the group served): the step counts once, in the
  // window (unless it was reset since) and in the totals.
  void Add(int layer, const core::ExpertLoadCounts& step, LoadStepKey key = {});

  // The layer's window (zeros and 0 steps for a layer with none); with
  // `reset`, the window starts again from zero. Totals are unaffected.
  core::ExpertLoadCounts Read(int layer, bool reset);

  // Tokens per logical expert of `layer` since Reset ([num_experts]; zeros
  // for a layer with no step).
  std::vector<int64_t> Totals(int layer) const;

 private:
  struct Layer {
    core::ExpertLoadCounts window;
    std::vector<int64_t> totals;
    LoadStepKey last_key;              // of the last Add
    std::vector<int64_t> last_counts;  // what it added
    int64_t last_steps = 0;
    bool last_in_window = false;  // not reset since
  };
  int num_experts_ = 0;
  std::map<int, Layer> layers_;
};

}  // namespace moe_ep::server
