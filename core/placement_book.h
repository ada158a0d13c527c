#pragma once

// The placement book of a data plane (DESIGN §15; issue 17 items 1-3): each
// MoE layer's placement table (the contiguous table of the workspace unless
// InstallPlacement put another there) and each layer's load counters
// (core/expert_load_book.h). Every data plane holds one (DataPlane::book_,
// server/data_plane.h) and keeps only its own test of which loaded experts a
// new table invalidates.
// Not thread-safe (its data plane's owner serializes the calls).

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/ep_dispatcher.h"
#include "core/expert_load_book.h"
#include "core/placement_table.h"

namespace moe_ep::core {

class PlacementBook {
 public:
  // Reset()
  //
  // Starts over for a new workspace: `contiguous` (not null) is every
  // layer's table, no layer has an installed one, and the load counters of
  // contiguous->num_experts() experts are empty.
  void Reset(std::shared_ptr<const PlacementTable> contiguous);

  // The contiguous table of the workspace (null before Reset), unmasked:
  // what the engine calls route by (server/cpu_engine_calls.cc).
  const std::shared_ptr<const PlacementTable>& contiguous() const { return contiguous_; }

  // Whether Reset has run (a workspace exists).
  bool ready() const { return contiguous_ != nullptr; }

  // Installed()
  //
  // The table InstallPlacement put on `layer`, or null when the layer uses
  // the contiguous one (LoadExperts checks an installed table slot by slot).
  const PlacementTable* Installed(int layer) const;

  // Install()
  //
  // Makes `table` (validated by the caller, not null) the table of `layer`.
  void Install(int layer, std::shared_ptr<const PlacementTable> table);

  // SetLive()
  //
  // The rank mask every table is served under from now on (DESIGN §15):
  // `live` [ep_size] (all true, or empty: no mask). Kept across Reset and
  // Install; a size that does not match a table leaves that table unmasked.
  void SetLive(std::vector<bool> live);

  // Placement()
  //
  // The table of `layer`: its installed one, else the contiguous one (null
  // before Reset), under the rank mask (PlacementTable::WithMask) when
  // one is set.
  std::shared_ptr<const PlacementTable> Placement(int layer) const;

  // AddLoad()
  //
  // Adds one step's drained counters of `layer` (ExpertLoadBook::Add; a
  // step resent after a mask round counts once).
  void AddLoad(int layer, const ExpertLoadCounts& step, LoadStepKey key = {}) {
    load_.Add(layer, step, key);
  }

  // ReadExpertLoad()
  //
  // The layer's window, reset after reading when `reset`
  // (ExpertLoadBook::Read). Errors: kFailedPrecondition "GetExpertLoad: no
  // workspace; call Allocate first" before Reset.
  absl::StatusOr<ExpertLoadCounts> ReadExpertLoad(int layer, bool reset);

  // ExpertTokenTotals()
  //
  // Tokens per logical expert of `layer` since Reset (ExpertLoadBook::Totals).
  std::vector<int64_t> ExpertTokenTotals(int layer) const { return load_.Totals(layer); }

 private:
  std::shared_ptr<const PlacementTable> contiguous_;
  std::map<int, std::shared_ptr<const PlacementTable>> tables_;
  std::vector<bool> live_;  // empty: no mask
  // Each table under the mask, made once per (layer, table, mask).
  mutable std::map<const PlacementTable*, std::shared_ptr<const PlacementTable>> masked_;
  ExpertLoadBook load_;
};

}  // namespace moe_ep::core
