#include "server/worker_lease.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace moe_ep::server {
namespace {

const std::string kNoOwner;

absl::Duration TtlOf(const v1::LeaseClaim& claim) {
  return claim.ttl_ms() > 0 ? absl::Milliseconds(claim.ttl_ms()) : kDefaultLeaseTtl;
}

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

}  // namespace

absl::Status ValidateLeaseClaim(const v1::LeaseClaim& claim, absl::string_view prefix) {
  if (claim.owner_id().size() > kMaxLeaseOwnerBytes) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "owner_id: expected at most ",
                                                   kMaxLeaseOwnerBytes, " bytes, got ",
                                                   claim.owner_id().size()));
  }
  if (claim.ttl_ms() < 0 || claim.ttl_ms() > absl::ToInt64Milliseconds(kMaxLeaseTtl)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "ttl_ms: expected in [0, ",
                                                   absl::ToInt64Milliseconds(kMaxLeaseTtl),
                                                   "] (0 = 30000), got ", claim.ttl_ms()));
  }
  if (claim.owner_id().empty() && (claim.ttl_ms() != 0 || claim.take_over())) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "owner_id: required with ",
                                                   claim.take_over() ? "take_over" : "ttl_ms"));
  }
  return absl::OkStatus();
}

WorkerLease::WorkerLease(Clock clock) : clock_(std::move(clock)) {}

const std::string& WorkerLease::LiveOwnerLocked(absl::Time now) const {
  return now < expires_ ? owner_ : kNoOwner;
}

absl::Status WorkerLease::CheckLocked(absl::string_view rpc, const v1::LeaseClaim& claim,
                                      absl::Time now) const {
  const std::string& owner = LiveOwnerLocked(now);
  if (owner.empty() || owner == claim.owner_id() || claim.take_over()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      rpc, ": this worker is leased by owner '", owner, "' for another ", Seconds(expires_ - now),
      "; ",
      claim.owner_id().empty() ? "this call claims no owner"
                               : absl::StrCat("this call claims owner '", claim.owner_id(), "'"),
      ". Wait for the lease to expire, or take it over explicitly (LeaseClaim.take_over; "
      "moe-ep --take-over)"));
}

absl::Status WorkerLease::Check(absl::string_view rpc, const v1::LeaseClaim& claim) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(rpc, claim, clock_());
}

void WorkerLease::ApplyLocked(const v1::LeaseClaim& claim, absl::Time now) {
  if (claim.owner_id().empty()) return;
  const std::string& owner = LiveOwnerLocked(now);
  if (!owner.empty() && owner != claim.owner_id() && !claim.take_over()) return;
  owner_ = claim.owner_id();
  expires_ = now + TtlOf(claim);
}

void WorkerLease::Apply(const v1::LeaseClaim& claim) {
  absl::MutexLock lock(&mu_);
  ApplyLocked(claim, clock_());
}

absl::StatusOr<v1::LeaseResponse> WorkerLease::Handle(const v1::LeaseRequest& request) {
  const v1::LeaseClaim& claim = request.claim();
  RETURN_IF_ERROR(ValidateLeaseClaim(claim, "claim."));
  if (claim.owner_id().empty()) {
    return absl::InvalidArgumentError("claim.owner_id: required (the id of the claiming client)");
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_();
  v1::LeaseResponse response;
  if (request.release()) {
    const std::string& owner = LiveOwnerLocked(now);
    if (!owner.empty() && owner != claim.owner_id()) {
      v1::LeaseClaim no_take_over = claim;
      no_take_over.set_take_over(false);
      return CheckLocked("Lease (release)", no_take_over, now);
    }
    owner_.clear();
    expires_ = absl::InfinitePast();
    return response;
  }
  RETURN_IF_ERROR(CheckLocked("Lease", claim, now));
  ApplyLocked(claim, now);
  response.set_owner_id(owner_);
  response.set_remaining_ms(absl::ToInt64Milliseconds(expires_ - now));
  return response;
}

void WorkerLease::Fill(v1::GetStatusResponse* status) const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_();
  const std::string& owner = LiveOwnerLocked(now);
  status->set_lease_owner(owner);
  status->set_lease_remaining_ms(owner.empty() ? 0 : absl::ToInt64Milliseconds(expires_ - now));
}

}  // namespace moe_ep::server
