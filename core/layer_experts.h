#pragma once

// The experts a data plane holds, by MoE layer (DESIGN §17 "the plane core
// ... owns, once, ... the experts registry and bytes, the placement book and
// one drop rule"; issue 34 item 1): whatever holds one layer's weights on a
// transport (a host core::ExpertSet on Gloo, a kernels::DeviceExpertSet on a
// GPU), with the logical ids its slots hold and its weight bytes recorded
// when it is put, so that the bytes, the memory cap and the drop rule under a
// new placement table are computed here for every transport alike.
//
// Type-erased: Put<T> and Find<T> must name the same T for a layer (a plane
// holds one type). Not thread-safe (the data plane's callers hold the
// worker's collective slot).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/placement_table.h"

namespace moe_ep::core {

class LayerExperts {
 public:
  // Put()
  //
  // Holds `experts` as `layer`'s (replacing and freeing the previous ones).
  // T needs expert_ids() (the logical expert of each slot, ascending) and
  // weight_bytes() (bytes of weights held). REQUIRES: experts != nullptr.
  template <typename T>
  void Put(int layer, std::unique_ptr<T> experts) {
    Entry entry;
    entry.expert_ids = experts->expert_ids();
    entry.bytes = experts->weight_bytes();
    entry.held = std::shared_ptr<void>(std::move(experts));
    layers_.insert_or_assign(layer, std::move(entry));
  }

  // `layer`'s experts as the T they were put as, or null when none.
  template <typename T>
  T* Find(int layer) const {
    auto it = layers_.find(layer);
    return it == layers_.end() ? nullptr : static_cast<T*>(it->second.held.get());
  }

  bool Has(int layer) const { return layers_.contains(layer); }
  // NotLoaded()
  //
  // kFailedPrecondition for a step of `layer` on `rank`, which holds none of
  // its experts here: "<call>: layer 99 has no loaded experts on rank 0
  // (layers with experts here: [0,1]); call LoadExperts first". Naming what
  // is loaded tells a layer outside the plan from one still loading (every
  // plane's Forward and engine forward; issue 30 item 1).
  absl::Status NotLoaded(absl::string_view call, int layer, int rank) const;
  // Bytes of `layer`'s expert weights (0 when none).
  int64_t Bytes(int layer) const;
  // Bytes of every layer's expert weights.
  int64_t TotalBytes() const;
  // Frees every layer's experts (a new workspace).
  void Clear() { layers_.clear(); }

  // KeepIfSlotsOf()
  //
  // The one drop rule under a new placement table (DESIGN §15, §17):
  // `layer`'s experts stay when they are `rank`'s distinct slot experts
  // under `table` (core::DistinctSlotExperts; any set of ids), else they are
  // freed (the caller loads the layer again). Returns whether they stay
  // (false when the layer had none). REQUIRES: 0 <= rank < table.ep_size().
  bool KeepIfSlotsOf(int layer, const PlacementTable& table, int rank);

 private:
  struct Entry {
    std::vector<int> expert_ids;
    int64_t bytes = 0;
    std::shared_ptr<void> held;  // the T of Put, freed by its own deleter
  };
  std::map<int, Entry> layers_;
};

}  // namespace moe_ep::core
