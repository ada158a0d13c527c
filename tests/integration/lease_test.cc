// Ownership of a group (DESIGN §16; issue 12 item 4): 3 real Gloo workers on
// loopback. A second client that changes state is refused with
// FAILED_PRECONDITION naming the owner; once the owner stops renewing, its
// lease lapses after the TTL and another client forms the group; `moe-ep
// bench --targets` against an owned group leaves every worker's status as
// it was. In a partly leased group (one rank leased by another owner) the
// refusal goes through the cross-rank vote: the refused rank answers
// FAILED_PRECONDITION, its peers ABORTED naming it and the owner, at once.
// InstallPlacement is leased like the other state-changing calls.

#include <chrono>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/lease_renewer.h"
#include "client/placement_request.h"
#include "core/placement_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cli_runner.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kLeaseWorld = 3;
constexpr int64_t kLeaseCapacity = 32;

class LeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto fake = FakeCoordinator::Start(kLeaseWorld);
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
    if (absl::Status s = c.ConfigureLayers(MakeConfigureRequest(kLeaseWorld, model)).status();
        !s.ok()) {
      return s;
    }
    return c.AllocateWorkspace(MakeAllocateRequest(model, kLeaseCapacity)).status();
  }

  // Every rank's GetStatus, without the lease's time left (it runs down)
  // and, unless `with_errors`, the error counter (a refused call counts).
  std::vector<std::string> Snapshot(bool with_errors = false) {
    std::vector<std::string> out;
    for (int r = 0; r < kLeaseWorld; ++r) {
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
  for (int r = 0; r < kLeaseWorld; ++r) {
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
      other->ConfigureLayers(MakeConfigureRequest(kLeaseWorld, model_)).status();
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
  EXPECT_TRUE(owner->ConfigureLayers(MakeConfigureRequest(kLeaseWorld, model_)).ok());
  auto sync = owner->SyncTokenCounts(1, {2, 3, 4});
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_EQ(sync->max_tokens, 4);

  // An explicit take-over: the new owner forms; the old one is refused.
  ASSERT_TRUE(other->AcquireLease(/*take_over=*/true).ok());
  ASSERT_TRUE(SetUpGroup(*other, model_).ok());
  EXPECT_EQ(fake_->StatusOf(0).lease_owner(), "moe-ep@b:7");
  const absl::Status old_owner =
      owner->ConfigureLayers(MakeConfigureRequest(kLeaseWorld, model_)).status();
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
  for (int r = 0; r < kLeaseWorld; ++r) {
    while (!fake_->StatusOf(r).lease_owner().empty()) {
      ASSERT_LT(absl::Now() - died, absl::Seconds(20)) << "rank " << r << " kept the lease";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::unique_ptr<client::Coordinator> other = Client("moe-ep@next:1");
  ASSERT_TRUE(other->AcquireLease(false).ok());
  const absl::Status formed = SetUpGroup(*other, model_);
  ASSERT_TRUE(formed.ok()) << formed;
  for (int r = 0; r < kLeaseWorld; ++r) {
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
                                                  "--num-experts 8 --top-k 2 --iterations 2"));
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
                            " --backend gloo --tokens 8 --hidden 64 --num-experts 8 --top-k 2 "
                            "--iterations 2 --take-over --owner bench@test"));
  EXPECT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_THAT(taken.output, HasSubstr("bench: 3 ranks"));
  for (int r = 0; r < kLeaseWorld; ++r) {
    EXPECT_EQ(fake_->StatusOf(r).lease_owner(), "");
    EXPECT_GT(fake_->StatusOf(r).generation(), owner->generation());
  }
}

// `moe-ep stack --targets` holds the workers' lease like bench and run
// (issue 12): against an owned group it is refused and changes nothing;
// with --take-over it takes the lease, runs and verifies, and gives the
// lease back when it exits.
TEST_F(LeaseTest, StackTargetsHoldsTheLease) {
  std::unique_ptr<client::Coordinator> owner = Client("coordinator@stack");
  ASSERT_TRUE(owner->AcquireLease(false).ok());
  ASSERT_TRUE(SetUpGroup(*owner, model_).ok());
  const std::vector<std::string> before = Snapshot(/*with_errors=*/true);
  const std::string stack =
      absl::StrCat("stack --targets ", absl::StrJoin(fake_->cluster().targets(), ","),
                   " --tp 3 --attn-dp 3 --hidden 32 --moe-intermediate 32 "
                   "--dense-intermediate 96 --steps 1 --layers 2");
  const CliResult refused = RunMoeEp(stack);
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("leased by another client; nothing was changed"));
  EXPECT_THAT(refused.output, HasSubstr("leased by owner 'coordinator@stack' for another "));
  EXPECT_EQ(Snapshot(/*with_errors=*/true), before);

  const CliResult taken = RunMoeEp(absl::StrCat(stack, " --take-over --owner stack@test"));
  EXPECT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_THAT(taken.output, HasSubstr("PASS: every DP group matches"));
  for (int r = 0; r < kLeaseWorld; ++r) {
    EXPECT_EQ(fake_->StatusOf(r).lease_owner(), "") << "rank " << r;
    EXPECT_GT(fake_->StatusOf(r).generation(), owner->generation());
  }
  // The old owner's calls are refused only while a lease is live: now none.
  EXPECT_TRUE(owner->AcquireLease(false).ok());
}

// Rank kLeased alone is leased by another owner (a partly leased group, e.g.
// a worker a second coordinator took over): each state-changing collective
// call of a client that does not hold it fails on every rank within 1 s
// (the group timeout is 5 s, the call's deadline 30 s), the peers ABORTED
// naming the rank and the owner, nothing changes, and once the lease is
// released the same call works without a new Join.
TEST_F(LeaseTest, APartlyLeasedGroupAbortsThePeersOfTheRefusedRankAtOnce) {
  constexpr int kLeased = 1;
  ASSERT_TRUE(fake_->SetUp(model_, kLeaseCapacity, v1::EXPERT_KIND_IDENTITY).ok());
  v1::LeaseRequest take;
  take.mutable_claim()->set_owner_id("other@host:9");
  take.mutable_claim()->set_ttl_ms(60000);
  {
    grpc::ClientContext context;
    v1::LeaseResponse response;
    ASSERT_TRUE(fake_->stub(kLeased).Lease(&context, take, &response).ok());
  }
  const std::vector<std::string> before = Snapshot();
  client::Coordinator& c = fake_->coordinator();  // claims no owner
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_IDENTITY);
  const auto expect_refused = [&](const std::string& rpc, const absl::Status& status,
                                  absl::Duration took) {
    EXPECT_LT(took, absl::Seconds(1)) << rpc << ": every rank must fail at once";
    std::cout << rpc << " with rank 1 leased by another owner: every rank answered in "
              << absl::ToDoubleMilliseconds(took) << " ms\n";
    // The code of the lowest failing rank (AggregateRankErrors): rank 0, ABORTED.
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
    const std::string m(status.message());
    EXPECT_THAT(m, HasSubstr(absl::StrCat(rpc, " failed on 3 of 3 ranks")));
    EXPECT_THAT(m, HasSubstr(absl::StrCat("rank 1 (", fake_->cluster().targets()[1],
                                          "): ", "FAILED_PRECONDITION: ", rpc,
                                          ": this worker is leased by owner 'other@host:9'")));
    for (int peer : {0, 2}) {
      EXPECT_THAT(m, HasSubstr(absl::StrCat("rank ", peer, " (", fake_->cluster().targets()[peer],
                                            "): ABORTED: ")))
          << rpc;
    }
    EXPECT_THAT(m, HasSubstr(absl::StrCat("rank 1 rejected its ", rpc,
                                          " request: FAILED_PRECONDITION: ", rpc,
                                          ": this worker is leased by owner 'other@host:9'")));
  };
  const auto timed = [](const std::function<absl::Status()>& call) {
    const absl::Time start = absl::Now();
    absl::Status status = call();
    return std::make_pair(status, absl::Now() - start);
  };
  auto [configure, t1] =
      timed([&] { return c.ConfigureLayers(MakeConfigureRequest(kLeaseWorld, model_)).status(); });
  expect_refused("ConfigureLayers", configure, t1);
  auto [allocate, t2] =
      timed([&] { return c.AllocateWorkspace(MakeAllocateRequest(model_, 16)).status(); });
  expect_refused("AllocateWorkspace", allocate, t2);
  auto [loaded, t3] = timed([&] { return c.LoadExperts(load).status(); });
  // LoadExperts is local (issue 29 item 3): only the leased rank refuses,
  // at once; its peers loaded (the same identity experts as before).
  EXPECT_LT(t3, absl::Seconds(1));
  EXPECT_EQ(loaded.code(), absl::StatusCode::kFailedPrecondition) << loaded;
  EXPECT_THAT(
      std::string(loaded.message()),
      HasSubstr(absl::StrCat("LoadExperts failed on 1 of 3 ranks: rank 1 (",
                             fake_->cluster().targets()[1], "): FAILED_PRECONDITION: ",
                             "LoadExperts: this worker is leased by owner 'other@host:9'")));
  const core::PlacementTable table =
      core::PlacementTable::Contiguous(model_.num_experts, kLeaseWorld).value();
  auto [placed, t4] = timed(
      [&] { return c.InstallPlacement(client::MakeInstallPlacementRequest(0, table)).status(); });
  expect_refused("InstallPlacement", placed, t4);
  // Nothing changed and the group is not broken.
  EXPECT_EQ(Snapshot(), before);
  for (int r = 0; r < kLeaseWorld; ++r) EXPECT_FALSE(fake_->StatusOf(r).group_broken());
  // Released: the same calls work without a new Join.
  take.set_release(true);
  {
    grpc::ClientContext context;
    v1::LeaseResponse response;
    ASSERT_TRUE(fake_->stub(kLeased).Lease(&context, take, &response).ok());
  }
  EXPECT_TRUE(c.AllocateWorkspace(MakeAllocateRequest(model_, 16)).ok());
  const absl::Status reloaded = c.LoadExperts(load).status();
  EXPECT_TRUE(reloaded.ok()) << reloaded;
  for (int r = 0; r < kLeaseWorld; ++r) EXPECT_EQ(fake_->StatusOf(r).capacity_tokens(), 16);
}

// InstallPlacement carries the client's claim (issue 12 item 4): the owner
// installs on its group; another owner and a client without a claim are
// refused on every rank, naming the owner, and the table stays as it was.
TEST_F(LeaseTest, InstallPlacementIsTheOwnersCall) {
  std::unique_ptr<client::Coordinator> owner = Client("coordinator@places");
  ASSERT_TRUE(owner->AcquireLease(false).ok());
  ASSERT_TRUE(SetUpGroup(*owner, model_).ok());
  const core::PlacementTable table =
      core::PlacementTable::Contiguous(model_.num_experts, kLeaseWorld).value();
  const v1::InstallPlacementRequest request = client::MakeInstallPlacementRequest(0, table);
  std::unique_ptr<client::Coordinator> other = Client("moe-ep@b:8");
  for (client::Coordinator* refused : {other.get(), &fake_->coordinator()}) {
    const absl::Status status = refused->InstallPlacement(request).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("InstallPlacement: this worker is leased by owner "
                          "'coordinator@places'"));
  }
  auto installed = owner->InstallPlacement(request);
  ASSERT_TRUE(installed.ok()) << installed.status();
  for (const v1::InstallPlacementResponse& r : *installed) {
    EXPECT_EQ(r.fingerprint(), table.Fingerprint());
  }
}

}  // namespace
}  // namespace moe_ep::testing
