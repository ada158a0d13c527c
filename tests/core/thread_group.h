#pragma once

// Test helper: runs one function per rank on its own thread and forms Gloo
// groups of N ranks inside one process over a shared in-memory HashStore
// (gloo::rendezvous::HashStore is thread-safe).

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/gloo_collective.h"
#include "gloo/rendezvous/hash_store.h"

namespace moe_ep::core::testing {

// Calls fn(rank) for rank in [0, n) on n threads and joins them all.
inline void RunOnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

inline std::shared_ptr<gloo::rendezvous::Store> NewHashStore() {
  return std::make_shared<gloo::rendezvous::HashStore>();
}

// Rank `rank` of a loopback Gloo group under `prefix`.
inline absl::StatusOr<std::unique_ptr<GlooCollective>> JoinLoopback(
    const std::shared_ptr<gloo::rendezvous::Store>& store, int rank, int size,
    absl::Duration timeout = absl::Seconds(20), const std::string& prefix = "gen1") {
  return GlooCollective::Create(store, prefix, rank, size, "127.0.0.1", timeout);
}

}  // namespace moe_ep::core::testing
