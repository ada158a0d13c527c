#include "client/lease_renewer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<std::unique_ptr<LeaseRenewer>> LeaseRenewer::Start(std::vector<std::string> targets,
                                                                  CoordinatorOptions options,
                                                                  bool take_over) {
  return Make(std::move(targets), std::move(options), take_over, /*best_effort=*/false);
}

absl::StatusOr<std::unique_ptr<LeaseRenewer>> LeaseRenewer::StartBestEffort(
    std::vector<std::string> targets, CoordinatorOptions options, bool take_over) {
  return Make(std::move(targets), std::move(options), take_over, /*best_effort=*/true);
}

absl::StatusOr<std::unique_ptr<LeaseRenewer>> LeaseRenewer::Make(std::vector<std::string> targets,
                                                                 CoordinatorOptions options,
                                                                 bool take_over, bool best_effort) {
  if (options.owner_id.empty()) {
    return absl::InvalidArgumentError("--owner: a lease needs an owner id, got none");
  }
  if (options.lease_ttl < absl::Milliseconds(30) || options.lease_ttl > absl::Hours(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lease-ttl-ms: expected in [30, 3600000], got ",
                     absl::ToInt64Milliseconds(options.lease_ttl)));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
                   Coordinator::Connect(std::move(targets), std::move(options)));
  absl::Status acquired = coordinator->AcquireLease(take_over).status();
  if (!best_effort) RETURN_IF_ERROR(acquired);
  std::unique_ptr<LeaseRenewer> renewer(new LeaseRenewer(std::move(coordinator)));
  renewer->last_renewal_ = std::move(acquired);
  renewer->thread_ = std::thread([r = renewer.get()] { r->Loop(); });
  return renewer;
}

LeaseRenewer::LeaseRenewer(std::unique_ptr<Coordinator> coordinator)
    : coordinator_(std::move(coordinator)) {}

LeaseRenewer::~LeaseRenewer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (release_on_exit_) (void)coordinator_->ReleaseLease();
}

void LeaseRenewer::Loop() {
  const auto interval = absl::ToChronoNanoseconds(coordinator_->options().lease_ttl / 3);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, interval, [this] { return stopping_; })) {
    lock.unlock();
    // Renewal only: another owner that took over keeps the lease.
    absl::Status status = coordinator_->AcquireLease(/*take_over=*/false).status();
    lock.lock();
    last_renewal_ = std::move(status);
    ++renewals_;
  }
}

absl::Status LeaseRenewer::last_renewal() {
  std::lock_guard<std::mutex> lock(mu_);
  return last_renewal_;
}

int64_t LeaseRenewer::renewals() {
  std::lock_guard<std::mutex> lock(mu_);
  return renewals_;
}

}  // namespace moe_ep::client
