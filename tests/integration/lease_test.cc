// Ownership of a group (DESIGN §16; issue 12 item 4): 3 real Gloo workers on
// loopback. A second client that changes state is refused with
// FAILED_PRECONDITION naming the owner; once the owner stops renewing, its
// lease lapses after the TTL and another client forms the group; `moe-ep
// bench --targets` against an owned group leaves every worker's status as
// it was.

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/lease_renewer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cli_runner.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 3;
constexpr int64_t kCapacity = 32;

class LeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto fake = FakeCoordinator::Start(kWorld);
    ASSERT_TRUE(fake.ok()) << fake.status();
    fake_ = std::move(*fake);
  }

  // A client of owner `owner` on the cluster's workers.
  std::unique_ptr<client::Coordinator> Client(const std::string& owner,
                                              absl::Duration ttl = absl::Seconds(30)) {
    client::CoordinatorOptions options;
    options.rpc_timeout = absl::Seconds(30);
    options.group_timeout = absl::Seconds(5);
    options.owner_id = owner;
    options.lease_ttl = ttl;
    auto coordinator = client::Coordinator::Connect(fake_->cluster().targets(), options);
    EXPECT_TRUE(coordinator.ok()) << coordinator.status();
    return coordinator.ok() ? std::move(*coordinator) : nullptr;
  }

  // Forms, configures and allocates the group through `c`.
  static absl::Status SetUpGroup(client::Coordinator& c, const SmallModel& model) {
    if (absl::Status s = c.FormGroup().status(); !s.ok()) return s;
    if (absl::Status s = c.ConfigureLayers(MakeConfigureRequest(kWorld, model)).status(); !s.ok()) {
      return s;
    }
    return c.AllocateWorkspace(MakeAllocateRequest(model, kCapacity)).status();
  }

  // Every rank's GetStatus, without the lease's time left (it runs down)
  // and, unless `with_errors`, the error counter (a refused call counts).
  std::vector<std::string> Snapshot(bool with_errors = false) {
    std::vector<std::string> out;
    for (int r = 0; r < kWorld; ++r) {
      v1::GetStatusResponse s = fake_->StatusOf(r);
      s.set_lease_remaining_ms(0);
      if (!with_errors) s.mutable_counters()->set_errors(0);
      out.push_back(s.ShortDebugString());
    }
    return out;
  }

  SmallModel model_;
  std::unique_ptr<FakeCoordinator> fake_;
};

TEST_F(LeaseTest, ASecondClientIsRefusedNamingTheOwnerAndTheOwnerGoesOn) {
  std::unique_ptr<client::Coordinator> owner = Client("coordinator@a");
  ASSERT_TRUE(owner->AcquireLease(/*take_over=*/false).ok());
  ASSERT_TRUE(SetUpGroup(*owner, model_).ok());
  for (int r = 0; r < kWorld; ++r) {
    const v1::GetStatusResponse s = fake_->StatusOf(r);
    EXPECT_EQ(s.lease_owner(), "coordinator@a");
    EXPECT_GT(s.lease_remaining_ms(), 20000);
    EXPECT_LE(s.lease_remaining_ms(), 30000);
  }
  const std::vector<std::string> before = Snapshot();

  // Another owner: every state-changing call is refused on every rank.
  std::unique_ptr<client::Coordinator> other = Client("moe-ep@b:7");
  const absl::Status lease = other->AcquireLease(/*take_over=*/false).status();
  EXPECT_EQ(lease.code(), absl::StatusCode::kFailedPrecondition) << lease;
  EXPECT_THAT(std::string(lease.message()), HasSubstr("leased by owner 'coordinator@a'"));
  const absl::Status form = other->FormGroup().status();
  EXPECT_EQ(form.code(), absl::StatusCode::kFailedPrecondition) << form;
  EXPECT_THAT(std::string(form.message()),
              HasSubstr("Leave: this worker is leased by owner 'coordinator@a' for another "));
  const absl::Status configure =
      other->ConfigureLayers(MakeConfigureRequest(kWorld, model_)).status();
  EXPECT_EQ(configure.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(configure.message()), HasSubstr("failed on 3 of 3 ranks: rank 0 ("));
  EXPECT_THAT(std::string(configure.message()),
              HasSubstr("ConfigureLayers: this worker is leased by owner 'coordinator@a'"));
  // A client of an earlier release (no claim) is refused too.
  const absl::Status anonymous =
      fake_->coordinator().AllocateWorkspace(MakeAllocateRequest(model_, 8)).status();
  EXPECT_EQ(anonymous.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(anonymous.message()), HasSubstr("this call claims no owner"));
  // A Join of a new generation straight to a worker: refused at once.
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::JoinRequest join;
    join.set_world_size(1);
    join.set_backend("gloo");
    join.set_generation(fake_->StatusOf(2).max_generation_seen() + 1);
    join.mutable_lease()->set_owner_id("moe-ep@b:7");
    v1::JoinResponse response;
    const grpc::Status status = fake_->stub(2).Join(&context, join, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(),
                HasSubstr("Join: this worker is leased by owner 'coordinator@a'"));
  }
  // Nothing changed, the owner's group still works.
  EXPECT_EQ(Snapshot(), before);
  EXPECT_TRUE(owner->ConfigureLayers(MakeConfigureRequest(kWorld, model_)).ok());
  auto sync = owner->SyncTokenCounts(1, {2, 3, 4});
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_EQ(sync->max_tokens, 4);

  // An explicit take-over: the new owner forms; the old one is refused.
  ASSERT_TRUE(other->AcquireLease(/*take_over=*/true).ok());
  ASSERT_TRUE(SetUpGroup(*other, model_).ok());
  EXPECT_EQ(fake_->StatusOf(0).lease_owner(), "moe-ep@b:7");
  const absl::Status old_owner =
      owner->ConfigureLayers(MakeConfigureRequest(kWorld, model_)).status();
  EXPECT_EQ(old_owner.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(old_owner.message()), HasSubstr("leased by owner 'moe-ep@b:7'"));
}

TEST_F(LeaseTest, ADeadOwnersLeaseLapsesAfterItsTtlAndAnotherClientForms) {
  const absl::Duration ttl = absl::Milliseconds(600);
  std::unique_ptr<client::Coordinator> owner = Client("coordinator@dies", ttl);
  {
    client::CoordinatorOptions options = owner->options();
    auto renewer = client::LeaseRenewer::Start(fake_->cluster().targets(), options, false);
    ASSERT_TRUE(renewer.ok()) << renewer.status();
    ASSERT_TRUE(SetUpGroup(*owner, model_).ok());
    // Renewed every ttl/3: still held after several TTLs.
    while ((*renewer)->renewals() < 7) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE((*renewer)->last_renewal().ok()) << (*renewer)->last_renewal();
    EXPECT_EQ(fake_->StatusOf(1).lease_owner(), "coordinator@dies");
    std::unique_ptr<client::Coordinator> other = Client("moe-ep@next:1");
    EXPECT_EQ(other->FormGroup().status().code(), absl::StatusCode::kFailedPrecondition);
    // The owner dies: renewing stops, nothing is given back.
    (*renewer)->set_release_on_exit(false);
  }
  // Within the TTL the group is still owned; after it, not.
  const absl::Time died = absl::Now();
  for (int r = 0; r < kWorld; ++r) {
    while (!fake_->StatusOf(r).lease_owner().empty()) {
      ASSERT_LT(absl::Now() - died, absl::Seconds(20)) << "rank " << r << " kept the lease";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::unique_ptr<client::Coordinator> other = Client("moe-ep@next:1");
  ASSERT_TRUE(other->AcquireLease(false).ok());
  const absl::Status formed = SetUpGroup(*other, model_);
  ASSERT_TRUE(formed.ok()) << formed;
  for (int r = 0; r < kWorld; ++r) {
    const v1::GetStatusResponse s = fake_->StatusOf(r);
    EXPECT_EQ(s.lease_owner(), "moe-ep@next:1");
    EXPECT_EQ(s.state(), v1::WORKER_STATE_ALLOCATED);
    EXPECT_EQ(s.generation(), other->generation());
  }
}

TEST_F(LeaseTest, BenchTargetsAgainstAnOwnedGroupLeavesItsStateAsItWas) {
  std::unique_ptr<client::Coordinator> owner = Client("coordinator@owns");
  ASSERT_TRUE(owner->AcquireLease(false).ok());
  ASSERT_TRUE(SetUpGroup(*owner, model_).ok());
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_SWIGLU);
  load.set_seed(3);
  load.set_intermediate_size(model_.intermediate);
  ASSERT_TRUE(owner->LoadExperts(load).ok());
  const std::vector<std::string> before = Snapshot(/*with_errors=*/true);
  ASSERT_GT(fake_->StatusOf(0).expert_bytes(), 0);

  const std::string targets = absl::StrJoin(fake_->cluster().targets(), ",");
  const CliResult refused = RunMoeEp(absl::StrCat("bench --targets ", targets,
                                                  " --backend gloo --tokens 8 --hidden 64 "
                                                  "--experts 8 --top-k 2 --iterations 2"));
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("leased by another client; nothing was changed"));
  EXPECT_THAT(refused.output, HasSubstr("leased by owner 'coordinator@owns' for another "));
  EXPECT_THAT(refused.output, HasSubstr("--take-over"));
  // Not even an error was counted: the refusal came from GetStatus alone.
  EXPECT_EQ(Snapshot(/*with_errors=*/true), before);

  // With --take-over it runs (and the group is then its to re-form); it
  // gives the lease back when it exits.
  const CliResult taken =
      RunMoeEp(absl::StrCat("bench --targets ", targets,
                            " --backend gloo --tokens 8 --hidden 64 --experts 8 --top-k 2 "
                            "--iterations 2 --take-over --owner bench@test"));
  EXPECT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_THAT(taken.output, HasSubstr("bench: 3 ranks"));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(fake_->StatusOf(r).lease_owner(), "");
    EXPECT_GT(fake_->StatusOf(r).generation(), owner->generation());
  }
}

}  // namespace
}  // namespace moe_ep::testing
