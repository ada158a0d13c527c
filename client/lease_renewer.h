#pragma once

// Holds a client's lease on its workers (LeaseClaim in worker.proto; DESIGN
// §16; issue 12 item 4): acquires it on every rank, renews it every ttl/3 on
// a thread of its own (over channels of its own), and gives it back when
// destroyed. `moe-ep` commands that drive --targets hold one for as long as
// they run (client/group_session.h); the coordinator service holds one for
// its group (client/group_keeper.h). A rank that is down is retried at the
// next renewal; a restarted worker (no lease) is leased again then.
//
// Thread-safe.

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/coordinator.h"

namespace moe_ep::client {

class LeaseRenewer {
 public:
  // Acquires the lease of options.owner_id (TTL options.lease_ttl) on every
  // target (Coordinator::AcquireLease: nothing is left taken when it fails),
  // then starts renewing. `take_over`: replace another owner's live lease.
  // Errors: kInvalidArgument (no owner_id, lease_ttl under 30 ms or over an
  // hour; Coordinator::Connect's); kFailedPrecondition naming the owner and
  // its remaining time when another owner holds a rank and not `take_over`.
  static absl::StatusOr<std::unique_ptr<LeaseRenewer>> Start(std::vector<std::string> targets,
                                                             CoordinatorOptions options,
                                                             bool take_over);
  // As Start, for a long-running owner (the coordinator service): a failed
  // first acquisition (a rank down, another owner) is not an error but the
  // first last_renewal(), and renewing starts anyway. Errors:
  // kInvalidArgument only.
  static absl::StatusOr<std::unique_ptr<LeaseRenewer>> StartBestEffort(
      std::vector<std::string> targets, CoordinatorOptions options, bool take_over);
  // Stops renewing; gives the lease back when `release_on_exit` (default).
  ~LeaseRenewer();
  LeaseRenewer(const LeaseRenewer&) = delete;
  LeaseRenewer& operator=(const LeaseRenewer&) = delete;

  void set_release_on_exit(bool release) { release_on_exit_ = release; }
  // The result of the last renewal (OK before the first).
  absl::Status last_renewal();
  int64_t renewals();

 private:
  explicit LeaseRenewer(std::unique_ptr<Coordinator> coordinator);
  static absl::StatusOr<std::unique_ptr<LeaseRenewer>> Make(std::vector<std::string> targets,
                                                            CoordinatorOptions options,
                                                            bool take_over, bool best_effort);
  void Loop();

  std::unique_ptr<Coordinator> coordinator_;
  bool release_on_exit_ = true;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  absl::Status last_renewal_;
  int64_t renewals_ = 0;
  std::thread thread_;
};

}  // namespace moe_ep::client
