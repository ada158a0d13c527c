#pragma once

// A worker's lease: which client owns its group, and until when (DESIGN §16
// "one coordinator owns a group at a time"; issue 12 item 4). The rules are
// those of LeaseClaim in proto/moe_ep/v1/worker.proto:
//   - at most one lease: an owner id and an expiry (the time of the last
//     successful claim + its TTL); a lease whose expiry has passed is gone,
//     so a dead owner's lease lapses after its TTL;
//   - Check(): a leased call may go ahead when there is no live lease, when
//     its claim names the holder, or when it takes over explicitly;
//     otherwise kFailedPrecondition naming the owner and the time left;
//   - Apply(): after the call succeeded, a claim acquires or renews the
//     lease (a call without a claim leaves it as it is);
//   - Handle(): the Lease RPC (acquire, renew, take over, release).
//
// The clock is injected (tests step it); the worker passes absl::Now.
// Thread-safe (one internal mutex, never held while calling out).

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::server {

// TTL of a claim that leaves ttl_ms at 0, and the longest one may ask.
inline constexpr absl::Duration kDefaultLeaseTtl = absl::Seconds(30);
inline constexpr absl::Duration kMaxLeaseTtl = absl::Hours(1);
inline constexpr size_t kMaxLeaseOwnerBytes = 128;

// ValidateLeaseClaim()
//
// OK for an empty claim (no owner, no take_over, ttl 0) and for a claim with
// an owner_id of 1..kMaxLeaseOwnerBytes bytes and ttl_ms in [0,
// kMaxLeaseTtl]. kInvalidArgument naming the field (`prefix` + "owner_id",
// "ttl_ms", "take_over") otherwise: a ttl or take_over without an owner, an
// owner too long, a ttl out of range.
absl::Status ValidateLeaseClaim(const v1::LeaseClaim& claim, absl::string_view prefix);

class WorkerLease {
 public:
  using Clock = std::function<absl::Time()>;
  explicit WorkerLease(Clock clock = absl::Now);

  // Whether the leased call `rpc` with `claim` may go ahead now. OK: no live
  // lease, the claim names the holder, or claim.take_over. Otherwise
  // kFailedPrecondition: "<rpc>: this worker is leased by owner '<id>' for
  // another <t>; ...". REQUIRES: ValidateLeaseClaim(claim) is OK.
  absl::Status Check(absl::string_view rpc, const v1::LeaseClaim& claim) const;

  // The call of `claim` succeeded: a claim with an owner becomes (or stays)
  // the holder, expiring its TTL from now, unless another owner acquired a
  // live lease meanwhile without `claim` taking over. No owner: no change.
  void Apply(const v1::LeaseClaim& claim);

  // The Lease RPC: validates (owner_id required), then releases (holder
  // only; OK when there is no live lease), or acquires / renews / takes over
  // as Check and Apply. Errors: kInvalidArgument; Check's
  // kFailedPrecondition (a release of another owner's lease too).
  absl::StatusOr<v1::LeaseResponse> Handle(const v1::LeaseRequest& request);

  // The live lease for GetStatus: owner ("" when none) and the time left.
  void Fill(v1::GetStatusResponse* status) const;

 private:
  // The holder when the lease is live at `now`, else "".
  const std::string& LiveOwnerLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckLocked(absl::string_view rpc, const v1::LeaseClaim& claim, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked(const v1::LeaseClaim& claim, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock clock_;
  mutable absl::Mutex mu_;
  std::string owner_ ABSL_GUARDED_BY(mu_);
  absl::Time expires_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace moe_ep::server
