// The worker's lease (server/worker_lease.h; issue 12 item 4) on a stepped
// clock: expiry after the TTL, renewal, take-over, release, validation.
#include "server/worker_lease.h"

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

v1::LeaseClaim Claim(const std::string& owner, int64_t ttl_ms = 0, bool take_over = false) {
  v1::LeaseClaim c;
  c.set_owner_id(owner);
  c.set_ttl_ms(ttl_ms);
  c.set_take_over(take_over);
  return c;
}

class WorkerLeaseTest : public ::testing::Test {
 protected:
  absl::Time now_ = absl::FromUnixSeconds(1000000);
  WorkerLease lease_{[this] { return now_; }};

  v1::GetStatusResponse Status() {
    v1::GetStatusResponse s;
    lease_.Fill(&s);
    return s;
  }
};

TEST_F(WorkerLeaseTest, AnUnownedWorkerAcceptsEveryCallAndAnUnclaimedOneTakesNoLease) {
  EXPECT_TRUE(lease_.Check("ConfigureLayers", v1::LeaseClaim()).ok());
  lease_.Apply(v1::LeaseClaim());
  EXPECT_EQ(Status().lease_owner(), "");
  EXPECT_EQ(Status().lease_remaining_ms(), 0);
}

TEST_F(WorkerLeaseTest, AnotherOwnerIsRefusedNamingTheOwnerAndTheTimeLeftUntilTheTtlPasses) {
  lease_.Apply(Claim("coordinator@a", 10000));
  now_ += absl::Milliseconds(2500);
  EXPECT_EQ(Status().lease_owner(), "coordinator@a");
  EXPECT_EQ(Status().lease_remaining_ms(), 7500);
  const absl::Status refused = lease_.Check("AllocateWorkspace", Claim("moe-ep@b:1"));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(),
              AllOf(HasSubstr("AllocateWorkspace: this worker is leased by owner 'coordinator@a' "
                              "for another 7.5 s"),
                    HasSubstr("this call claims owner 'moe-ep@b:1'"), HasSubstr("take_over")));
  // An unclaimed call counts as another owner.
  EXPECT_THAT(lease_.Check("Leave", v1::LeaseClaim()).message(),
              HasSubstr("this call claims no owner"));
  // A refused claim that is applied anyway (a race) does not replace the holder.
  lease_.Apply(Claim("moe-ep@b:1"));
  EXPECT_EQ(Status().lease_owner(), "coordinator@a");
  // The owner itself goes ahead.
  EXPECT_TRUE(lease_.Check("Leave", Claim("coordinator@a")).ok());
  // The owner stops renewing: at exactly the TTL the lease is gone.
  now_ += absl::Milliseconds(7499);
  EXPECT_FALSE(lease_.Check("Join", Claim("moe-ep@b:1")).ok());
  now_ += absl::Milliseconds(1);
  EXPECT_TRUE(lease_.Check("Join", Claim("moe-ep@b:1")).ok());
  EXPECT_EQ(Status().lease_owner(), "");
  lease_.Apply(Claim("moe-ep@b:1", 500));
  EXPECT_EQ(Status().lease_owner(), "moe-ep@b:1");
  EXPECT_EQ(Status().lease_remaining_ms(), 500);
}

TEST_F(WorkerLeaseTest, RenewalMovesTheExpiryTtlFromTheRenewal) {
  lease_.Apply(Claim("a", 1000));
  for (int i = 0; i < 5; ++i) {
    now_ += absl::Milliseconds(900);
    ASSERT_TRUE(lease_
                    .Handle([] {
                      v1::LeaseRequest r;
                      *r.mutable_claim() = Claim("a", 1000);
                      return r;
                    }())
                    .ok());
  }
  // 4.5 s after the first claim, a 1 s lease is still live: renewed 0.0 s ago.
  EXPECT_EQ(Status().lease_remaining_ms(), 1000);
  EXPECT_FALSE(lease_.Check("LoadExperts", Claim("b")).ok());
  // The default TTL is 30 s.
  lease_.Apply(Claim("a"));
  EXPECT_EQ(Status().lease_remaining_ms(), 30000);
}

TEST_F(WorkerLeaseTest, TakeOverReplacesALiveLeaseAndTheOldOwnerIsThenRefused) {
  lease_.Apply(Claim("old", 60000));
  v1::LeaseRequest take;
  *take.mutable_claim() = Claim("new", 20000, /*take_over=*/true);
  absl::StatusOr<v1::LeaseResponse> taken = lease_.Handle(take);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->owner_id(), "new");
  EXPECT_EQ(taken->remaining_ms(), 20000);
  EXPECT_THAT(lease_.Check("ConfigureLayers", Claim("old")).message(),
              HasSubstr("leased by owner 'new' for another 20.0 s"));
  // Without take_over the Lease RPC is refused like any leased call.
  v1::LeaseRequest steal;
  *steal.mutable_claim() = Claim("old");
  EXPECT_EQ(lease_.Handle(steal).status().code(), absl::StatusCode::kFailedPrecondition);
  // A take-over claim on a leased call passes the check and wins on Apply.
  EXPECT_TRUE(lease_.Check("Join", Claim("old", 0, true)).ok());
  lease_.Apply(Claim("old", 0, true));
  EXPECT_EQ(Status().lease_owner(), "old");
}

TEST_F(WorkerLeaseTest, OnlyTheHolderReleasesAndAReleaseOfNothingIsANoOp) {
  v1::LeaseRequest release;
  *release.mutable_claim() = Claim("a");
  release.set_release(true);
  EXPECT_TRUE(lease_.Handle(release).ok());
  lease_.Apply(Claim("b", 5000));
  const absl::Status refused = lease_.Handle(release).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("leased by owner 'b'"));
  EXPECT_EQ(Status().lease_owner(), "b");
  *release.mutable_claim() = Claim("b");
  absl::StatusOr<v1::LeaseResponse> released = lease_.Handle(release);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(released->owner_id(), "");
  EXPECT_EQ(Status().lease_owner(), "");
  EXPECT_TRUE(lease_.Check("Leave", Claim("c")).ok());
}

TEST_F(WorkerLeaseTest, ClaimsAreValidatedFieldByField) {
  EXPECT_TRUE(ValidateLeaseClaim(v1::LeaseClaim(), "lease.").ok());
  EXPECT_TRUE(ValidateLeaseClaim(Claim("a", 3600000, true), "lease.").ok());
  EXPECT_THAT(ValidateLeaseClaim(Claim("a", 3600001), "lease.").message(),
              HasSubstr("lease.ttl_ms: expected in [0, 3600000] (0 = 30000), got 3600001"));
  EXPECT_THAT(ValidateLeaseClaim(Claim("a", -1), "lease.").message(), HasSubstr("got -1"));
  EXPECT_THAT(ValidateLeaseClaim(Claim("", 0, true), "claim.").message(),
              HasSubstr("claim.owner_id: required with take_over"));
  EXPECT_THAT(ValidateLeaseClaim(Claim("", 5), "lease.").message(),
              HasSubstr("lease.owner_id: required with ttl_ms"));
  EXPECT_THAT(ValidateLeaseClaim(Claim(std::string(129, 'x')), "lease.").message(),
              HasSubstr("lease.owner_id: expected at most 128 bytes, got 129"));
  v1::LeaseRequest anonymous;
  EXPECT_EQ(lease_.Handle(anonymous).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::server
