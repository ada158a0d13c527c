#include "server/data_plane.h"

#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/bf16.h"
#include "core/experts.h"
#include "core/gloo_collective.h"
#include "core/moe_reference.h"
#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/call_gate.h"
#include "server/device_info.h"
#include "server/grpc_store.h"
#include "server/nccl_id_share.h"
#include "server/rendezvous_service.h"

// FormDataPlane's backend dispatch and the CPU data plane through the
// DataPlane interface (one rank, in-process store). The GPU plane is tested
// through the service in tests/server/gpu_worker_service_test.cc.

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

DataPlaneGroup OneRank(PlaneRequest plane) {
  DataPlaneGroup group;
  group.plane = plane;
  group.world_size = 1;
  group.rank = 0;
  group.generation = 3;
  group.timeout = absl::Seconds(5);
  return group;
}

core::EpDispatcherOptions HandOptions() {
  core::EpDispatcherOptions options;
  options.workspace.ep_size = 1;
  options.workspace.capacity_tokens = 8;
  options.workspace.hidden = 4;
  options.workspace.top_k = 2;
  options.workspace.dtype = core::DispatchDType::kBF16;
  options.num_experts = 4;
  return options;
}

std::vector<core::bf16_t> Bf16(const std::vector<float>& values) {
  std::vector<core::bf16_t> out;
  out.reserve(values.size());
  for (float v : values) out.push_back(core::FloatToBf16(v));
  return out;
}

std::vector<float> Floats(const std::vector<core::bf16_t>& values) {
  std::vector<float> out;
  out.reserve(values.size());
  for (core::bf16_t v : values) out.push_back(core::Bf16ToFloat(v));
  return out;
}

TEST(NcclUniqueIdKey, IsPrefixedByTheGeneration) {
  EXPECT_EQ(NcclUniqueIdKey(7), "gen7/nccl_unique_id");
}

// Rank 0's Rendezvous service on a loopback port, reached through GrpcStore.
class UniqueIdRendezvous : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override { server_->Shutdown(); }

  DataPlaneGroup Rank(int rank, int64_t generation, absl::Duration timeout) {
    DataPlaneGroup group;
    group.plane = PlaneRequest::kNccl;
    group.world_size = 2;
    group.rank = rank;
    group.generation = generation;
    group.timeout = timeout;
    group.rendezvous_address = address_;
    return group;
  }
  GrpcStore Store(absl::Duration timeout) { return GrpcStore(address_, timeout); }

  RendezvousService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

std::string FakeId(char fill) { return std::string(kNcclUniqueIdBytes, fill); }

TEST_F(UniqueIdRendezvous, RankZeroPublishesAndTheOthersGetTheSameBytes) {
  absl::StatusOr<std::string> got;
  // Rank 1 asks first and waits for rank 0.
  std::thread rank1([&] {
    GrpcStore store = Store(absl::Seconds(10));
    got = ExchangeNcclUniqueId(Rank(1, 4, absl::Seconds(10)), store,
                               [] { return absl::StatusOr<std::string>(FakeId('x')); });
  });
  GrpcStore store = Store(absl::Seconds(10));
  absl::StatusOr<std::string> made = ExchangeNcclUniqueId(Rank(0, 4, absl::Seconds(10)), store, [] {
    return absl::StatusOr<std::string>(FakeId('\x7f'));
  });
  rank1.join();
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*made, FakeId('\x7f'));
  EXPECT_EQ(*got, *made);  // rank 1's own make_id is never called
  EXPECT_EQ(service_.NumKeys(), 1);
}

TEST_F(UniqueIdRendezvous, MissingRankZeroIsDeadlineExceededNamingKeyAndAddress) {
  GrpcStore store = Store(absl::Milliseconds(300));
  absl::StatusOr<std::string> got =
      ExchangeNcclUniqueId(Rank(1, 9, absl::Milliseconds(300)), store,
                           [] { return absl::StatusOr<std::string>(FakeId('x')); });
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("rank 0 did not publish the NCCL unique id under \"gen9/nccl_unique_id\" "
                        "at " +
                        address_));
}

TEST_F(UniqueIdRendezvous, AnIdOfAnotherGenerationIsNotUsed) {
  GrpcStore store0 = Store(absl::Seconds(5));
  ASSERT_TRUE(ExchangeNcclUniqueId(Rank(0, 1, absl::Seconds(5)), store0, [] {
                return absl::StatusOr<std::string>(FakeId('a'));
              }).ok());
  GrpcStore store1 = Store(absl::Milliseconds(300));
  absl::StatusOr<std::string> got =
      ExchangeNcclUniqueId(Rank(1, 2, absl::Milliseconds(300)), store1,
                           [] { return absl::StatusOr<std::string>(FakeId('x')); });
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
}

TEST_F(UniqueIdRendezvous, WrongSizedValueIsUnavailable) {
  GrpcStore store = Store(absl::Seconds(5));
  store.set(NcclUniqueIdKey(3), std::vector<char>(5, 'z'));
  absl::StatusOr<std::string> got = ExchangeNcclUniqueId(
      Rank(1, 3, absl::Seconds(5)), store, [] { return absl::StatusOr<std::string>(FakeId('x')); });
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("from rank 0 (under \"gen3/nccl_unique_id\" at " + address_ +
                        ") has 5 bytes, expected 512"));
}

// Rank 0's failure is published: rank 1, with a timeout far longer than the
// test, gets rank 0's error (a wait to its timeout would end in
// kDeadlineExceeded "rank 0 did not publish ...").
TEST_F(UniqueIdRendezvous, RankZeroPublishesItsFailedIdAndRankOneGetsItsError) {
  absl::StatusOr<std::string> got;
  bool rank1_made_id = false;
  std::thread rank1([&] {
    GrpcStore store = Store(absl::Seconds(300));
    got = ExchangeNcclUniqueId(Rank(1, 5, absl::Seconds(300)), store, [&] {
      rank1_made_id = true;
      return absl::StatusOr<std::string>(FakeId('x'));
    });
  });
  GrpcStore store = Store(absl::Seconds(300));
  absl::StatusOr<std::string> made =
      ExchangeNcclUniqueId(Rank(0, 5, absl::Seconds(300)), store, [] {
        return absl::StatusOr<std::string>(absl::UnavailableError("ncclGetUniqueId: no interface"));
      });
  rank1.join();
  const std::string want =
      "rank 0 could not make the NCCL unique id: ncclGetUniqueId: no interface";
  EXPECT_EQ(made.status().code(), absl::StatusCode::kUnavailable) << made.status();
  EXPECT_EQ(made.status().message(), want);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_EQ(got.status().message(), want);
  EXPECT_FALSE(rank1_made_id);
  EXPECT_EQ(service_.NumKeys(), 1);
}

// ShareNcclUniqueId over two members of a mask round: Gloo groups through
// this fixture's Rendezvous service, each member with its own GrpcStore.
// Member 1's id source counts its calls in `member1_calls`. The timeouts
// (300 s) are far longer than the test runs.
std::vector<absl::StatusOr<std::string>> ShareOverTwoMembers(
    const std::string& address, const std::function<absl::StatusOr<std::string>()>& make_id0,
    std::atomic<int>* member1_calls) {
  std::vector<absl::StatusOr<std::string>> got(2, absl::UnknownError("not run"));
  const std::function<absl::StatusOr<std::string>()> make_id1 = [member1_calls] {
    ++*member1_calls;
    return absl::StatusOr<std::string>(FakeId('x'));
  };
  std::vector<std::thread> members;
  members.reserve(2);
  for (int m = 0; m < 2; ++m) {
    members.emplace_back([&, m] {
      auto store = std::make_shared<GrpcStore>(address, absl::Seconds(300));
      absl::StatusOr<std::unique_ptr<core::GlooCollective>> group =
          core::GlooCollective::Create(store, "gen1/mask2", m, 2, "127.0.0.1", absl::Seconds(300));
      got[m] = group.ok()
                   ? ShareNcclUniqueId(**group, m == 0 ? make_id0 : make_id1, "rank 3 (member 0)")
                   : group.status();
    });
  }
  for (std::thread& t : members) t.join();
  return got;
}

TEST_F(UniqueIdRendezvous, BothMaskRoundMembersGetMemberZerosId) {
  const std::string id = std::string(100, '\x42') + std::string(28, '\0');
  std::atomic<int> member1_calls{0};
  std::vector<absl::StatusOr<std::string>> got = ShareOverTwoMembers(
      address_, [&] { return absl::StatusOr<std::string>(id); }, &member1_calls);
  for (int m = 0; m < 2; ++m) {
    ASSERT_TRUE(got[m].ok()) << "member " << m << ": " << got[m].status();
    EXPECT_EQ(*got[m], id) << "member " << m;
  }
  EXPECT_EQ(member1_calls.load(), 0);
}

// Member 0's failure reaches member 1 through the all-gather: a wait for an
// id would end only at the 300 s timeout, as kDeadlineExceeded from Gloo.
TEST_F(UniqueIdRendezvous, MemberZerosFailedIdReachesBothMembersNamingIt) {
  std::atomic<int> member1_calls{0};
  std::vector<absl::StatusOr<std::string>> got = ShareOverTwoMembers(
      address_,
      [] {
        return absl::StatusOr<std::string>(
            absl::UnavailableError("ncclGetUniqueId: unhandled system error"));
      },
      &member1_calls);
  const std::string want =
      "rank 3 (member 0) could not make the NCCL unique id: ncclGetUniqueId: unhandled system "
      "error";
  for (int m = 0; m < 2; ++m) {
    EXPECT_EQ(got[m].status().code(), absl::StatusCode::kUnavailable)
        << "member " << m << ": " << got[m].status();
    EXPECT_EQ(got[m].status().message(), want) << "member " << m;
  }
  EXPECT_EQ(member1_calls.load(), 0);
}

TEST(FormDataPlane, NcclWithoutCudaBuildIsFailedPrecondition) {
  if (BuiltWithCuda()) GTEST_SKIP() << "CUDA build: NCCL is available";
  absl::StatusOr<std::unique_ptr<DataPlane>> plane =
      FormDataPlane(OneRank(PlaneRequest::kNccl), std::make_shared<gloo::rendezvous::HashStore>());
  EXPECT_EQ(plane.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plane.status().message()), HasSubstr("NCCL backend needs a CUDA build"));
}

TEST(FormDataPlane, NcclWithoutVisibleGpuNamesTheDevice) {
  if (!BuiltWithCuda() || VisibleGpuCount() > 0) {
    GTEST_SKIP() << "needs a CUDA build on a machine without a GPU";
  }
  absl::StatusOr<std::unique_ptr<DataPlane>> plane =
      FormDataPlane(OneRank(PlaneRequest::kNccl), std::make_shared<gloo::rendezvous::HashStore>());
  EXPECT_EQ(plane.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plane.status().message()),
              HasSubstr("Join (rank 0 of 1, generation 3): device: CUDA device 0 is not visible"));
}

TEST(CpuDataPlane, ForwardsHandTokensThroughIdentityExperts) {
  absl::StatusOr<std::unique_ptr<DataPlane>> formed =
      FormDataPlane(OneRank(PlaneRequest::kGloo), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(formed.ok()) << formed.status();
  DataPlane& plane = **formed;
  EXPECT_EQ(plane.backend(), "gloo");
  EXPECT_EQ(plane.collective().size(), 1);
  EXPECT_EQ(plane.allocated_bytes(), 0);

  absl::StatusOr<DataPlaneAllocation> allocation = plane.Allocate(HandOptions(), 0, 0);
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  // The CPU plane allocates exactly core::ComputeAllocatedWorkspace.
  const core::AllocatedWorkspace expected =
      *core::ComputeAllocatedWorkspace(HandOptions().workspace);
  EXPECT_EQ(allocation->allocated_bytes, expected.total_bytes);
  EXPECT_EQ(allocation->regions.size(), expected.regions.size());
  EXPECT_EQ(plane.allocated_bytes(), expected.total_bytes);

  EXPECT_FALSE(plane.HasExperts(0));
  ASSERT_EQ(*plane.LoadExperts(0, core::ExpertSource::Identity(0, 4, 0, 4, 4), 0), 0);
  EXPECT_TRUE(plane.HasExperts(0));
  EXPECT_EQ(plane.ExpertBytes(0), 0);

  EXPECT_THAT(*plane.SyncTokenCounts(2), ElementsAre(2));
  ASSERT_TRUE(plane.CommitGeometry(5, 2, 2).ok());
  EXPECT_EQ(plane.epoch(), 5);

  // Token 0: ids {0, 3}, w {0.25, 0.5} -> 0.75 x0; token 1: ids {1, -1}
  // ("no expert"), w {0.75, 0.125} -> 0.75 x1. All values exact in bf16.
  const std::vector<core::bf16_t> hidden = Bf16({1, 2, 3, 4, 0.5f, -1, 2, 8});
  const std::vector<int32_t> ids = {0, 3, 1, -1};
  const std::vector<float> weights = {0.25f, 0.5f, 0.75f, 0.125f};
  std::vector<core::bf16_t> output(8);
  absl::StatusOr<core::StepStats> stats =
      plane.Forward(0, hidden, ids, weights, 2, absl::MakeSpan(output));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_THAT(Floats(output), ElementsAre(0.75f, 1.5f, 2.25f, 3.0f, 0.375f, -0.75f, 1.5f, 6.0f));
  EXPECT_EQ(stats->tokens_sent, 2);  // one rank: each token once
  EXPECT_EQ(stats->tokens_received, 2);
  EXPECT_EQ(stats->bytes_sent_remote, 0);
  EXPECT_EQ(stats->runtime_max_tokens_per_rank, 2);

  // A layer without experts.
  absl::StatusOr<core::StepStats> missing =
      plane.Forward(1, hidden, ids, weights, 2, absl::MakeSpan(output));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("Forward: layer 1 has no loaded experts on rank 0 (layers with experts "
                        "here: [0]); call LoadExperts first"));

  // SwiGLU experts replace the layer's: 4 experts x 3 x I*H x 2 bytes.
  EXPECT_EQ(*plane.LoadExperts(0, core::ExpertSource::Seeded(1, 0, 4, 0, 4, 4, 6), 0),
            4 * 3 * 6 * 4 * 2);
  EXPECT_EQ(plane.ExpertBytes(0), 4 * 3 * 6 * 4 * 2);

  // A new allocation drops every layer's experts.
  ASSERT_TRUE(plane.Allocate(HandOptions(), 0, 0).ok());
  EXPECT_FALSE(plane.HasExperts(0));
}

// The source is checked against the workspace before anything is made; a
// refused source leaves the layer's experts as they were.
TEST(CpuDataPlane, LoadExpertsRefusesASourceThatDoesNotFitTheWorkspace) {
  absl::StatusOr<std::unique_ptr<DataPlane>> formed =
      FormDataPlane(OneRank(PlaneRequest::kGloo), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(formed.ok()) << formed.status();
  DataPlane& plane = **formed;
  absl::StatusOr<int64_t> early =
      plane.LoadExperts(0, core::ExpertSource::Identity(0, 4, 0, 4, 4), 0);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(early.status().message()), HasSubstr("call Allocate first"));
  ASSERT_TRUE(plane.Allocate(HandOptions(), 0, 0).ok());
  ASSERT_TRUE(plane.LoadExperts(0, core::ExpertSource::Seeded(1, 0, 4, 0, 4, 4, 6), 0).ok());

  struct Bad {
    core::ExpertSource source;
    const char* fragment;
  };
  for (const Bad& bad : {
           // One rank of four experts owns [0, 4).
           Bad{core::ExpertSource::Seeded(1, 0, 4, 1, 3, 4, 6),
               "expert range: expected [0, 4) for rank 0 of 1 (contiguous placement of 4 "
               "experts), got [1, 4)"},
           Bad{core::ExpertSource::Seeded(1, 0, 8, 0, 8, 4, 6),
               "num_routed_experts: expected the workspace's 4, got 8"},
           Bad{core::ExpertSource::Seeded(1, 0, 4, 0, 4, 8, 6),
               "hidden: expected the workspace's 4, got 8"},
           Bad{core::ExpertSource::Safetensors("/nonexistent/moe_ep/ckpt.safetensors",
                                               "l.{layer}.e.{expert}.{proj}", 0, 4, 0, 4, 4, 6),
               "safetensors checkpoint /nonexistent/moe_ep/ckpt.safetensors: no such path"},
       }) {
    absl::StatusOr<int64_t> refused = plane.LoadExperts(0, bad.source, 0);
    EXPECT_FALSE(refused.ok());
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr(bad.fragment));
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("layer 0 experts ["));
  }
  // The seeded set stayed.
  EXPECT_EQ(plane.ExpertBytes(0), 4 * 3 * 6 * 4 * 2);
}

TEST(CpuDataPlane, AllocateBeyondTheCapKeepsThePreviousWorkspace) {
  absl::StatusOr<std::unique_ptr<DataPlane>> formed =
      FormDataPlane(OneRank(PlaneRequest::kGloo), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(formed.ok()) << formed.status();
  DataPlane& plane = **formed;
  ASSERT_TRUE(plane.Allocate(HandOptions(), 0, 0).ok());
  const int64_t held = plane.allocated_bytes();
  core::EpDispatcherOptions big = HandOptions();
  big.workspace.capacity_tokens = 4096;
  absl::StatusOr<DataPlaneAllocation> refused = plane.Allocate(big, 0, 4096);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(plane.allocated_bytes(), held);
}

// The core answers CommitGeometry and check_step over the transport's
// dispatcher (core::StepDispatcher): refused without a workspace, the
// dispatcher's bounds after (capacity 8), the previous geometry kept on error.
TEST(CpuDataPlane, CommitGeometryAndCheckStepGoThroughTheServingDispatcher) {
  absl::StatusOr<std::unique_ptr<DataPlane>> formed =
      FormDataPlane(OneRank(PlaneRequest::kGloo), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(formed.ok()) << formed.status();
  DataPlane& plane = **formed;
  absl::Status early = plane.CommitGeometry(1, 2, 2);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(early.message()), HasSubstr("no workspace; call Allocate first"));
  EXPECT_EQ(plane.EngineCheckStep().code(), absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE(plane.Allocate(HandOptions(), 0, 0).ok());
  EXPECT_EQ(plane.epoch(), -1);
  EXPECT_EQ(plane.CommitGeometry(1, 9, 2).code(), absl::StatusCode::kResourceExhausted);  // R > 8
  EXPECT_EQ(plane.CommitGeometry(1, 2, 3).code(), absl::StatusCode::kInvalidArgument);    // T > R
  EXPECT_EQ(plane.epoch(), -1);
  ASSERT_TRUE(plane.CommitGeometry(7, 8, 8).ok());
  EXPECT_EQ(plane.epoch(), 7);
  EXPECT_EQ(plane.CommitGeometry(8, 9, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(plane.epoch(), 7);
  EXPECT_TRUE(plane.EngineCheckStep().ok());
  // A new workspace forgets the geometry.
  ASSERT_TRUE(plane.Allocate(HandOptions(), 0, 0).ok());
  EXPECT_EQ(plane.epoch(), -1);
}

TEST(CpuDataPlane, BenchmarkTimesEveryIterationAfterWarmup) {
  absl::StatusOr<std::unique_ptr<DataPlane>> formed =
      FormDataPlane(OneRank(PlaneRequest::kGloo), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(formed.ok()) << formed.status();
  BenchmarkInputs inputs;
  inputs.num_tokens = 2;
  inputs.hidden = Bf16({1, 2, 3, 4, 0.5f, -1, 2, 8});
  inputs.topk_ids = {0, 3, 1, 2};
  inputs.topk_weights = {0.5f, 0.5f, 0.5f, 0.5f};
  core::EpDispatcherOptions options = HandOptions();
  options.workspace.capacity_tokens = 2;
  absl::StatusOr<BenchmarkTimes> times = (*formed)->Benchmark(options, inputs, 2, 5, 0, "");
  ASSERT_TRUE(times.ok()) << times.status();
  EXPECT_EQ(times->dispatch_us.size(), 5u);
  EXPECT_EQ(times->combine_us.size(), 5u);
  EXPECT_EQ(times->tokens_sent, 2);
  EXPECT_EQ(times->data_plane, "gloo");
  EXPECT_EQ((*formed)->data_plane(), "gloo");
  // A GPU plane is not this group's to time.
  absl::StatusOr<BenchmarkTimes> other =
      (*formed)->Benchmark(options, inputs, 2, 5, 0, "one-sided");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find("data_plane \"one-sided\" cannot run on this group "
                                          "(gloo data plane); it can time \"gloo\""),
            std::string::npos)
      << other.status();
}

TEST(ResolveBenchmarkPlane, OwnPlaneOrOneItCanTime) {
  EXPECT_EQ(*ResolveBenchmarkPlane("", "nccl", {"one-sided"}), "nccl");
  EXPECT_EQ(*ResolveBenchmarkPlane("nccl", "nccl", {"one-sided"}), "nccl");
  EXPECT_EQ(*ResolveBenchmarkPlane("one-sided", "nccl", {"one-sided"}), "one-sided");
  absl::StatusOr<std::string> refused = ResolveBenchmarkPlane("nccl", "one-sided", {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("it can time \"one-sided\""), std::string::npos)
      << refused.status();
  EXPECT_NE(ResolveBenchmarkPlane("gloo", "nccl", {"one-sided"})
                .status()
                .message()
                .find("it can time \"nccl\", \"one-sided\""),
            std::string::npos);
}

// Found by the long fuzz run (bench/results/fuzz-long/): a Benchmark whose
// iterations outlast its call kept the collective slot long after the client
// gave up. Past the call's deadline it stops before the next iteration.
TEST(CpuDataPlane, BenchmarkStopsAtTheCallsDeadline) {
  absl::StatusOr<std::unique_ptr<DataPlane>> formed =
      FormDataPlane(OneRank(PlaneRequest::kGloo), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(formed.ok()) << formed.status();
  BenchmarkInputs inputs;
  inputs.num_tokens = 2;
  inputs.hidden = Bf16({1, 2, 3, 4, 0.5f, -1, 2, 8});
  inputs.topk_ids = {0, 3, 1, 2};
  inputs.topk_weights = {0.5f, 0.5f, 0.5f, 0.5f};
  core::EpDispatcherOptions options = HandOptions();
  options.workspace.capacity_tokens = 2;
  (*formed)->SetCall(CallBound{absl::Now() - absl::Seconds(1), nullptr});
  absl::StatusOr<BenchmarkTimes> late = (*formed)->Benchmark(options, inputs, 2, 5, 0, "");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(late.status().message().find("after 0 of 7 iterations"), std::string::npos)
      << late.status();
  // The group stays whole: with no deadline the same Benchmark runs.
  (*formed)->SetCall(CallBound{});
  absl::StatusOr<BenchmarkTimes> times = (*formed)->Benchmark(options, inputs, 2, 5, 0, "");
  ASSERT_TRUE(times.ok()) << times.status();
  EXPECT_EQ(times->dispatch_us.size(), 5u);
}

// A CallBound whose client cancels at the gate check number `at` (1 = the
// first gate): deterministic stops at a chosen gate point.
CallBound CancelledAtCheck(int at, const std::shared_ptr<int>& checks) {
  return CallBound{absl::InfiniteFuture(), [at, checks] { return ++*checks >= at; }};
}

// Issue 13 item 6: Forward passes a call gate before dispatch and another
// between expert compute and combine; a stop at either names its point,
// adds nothing to the layer's load counters, and the next Forward on the
// same plane gives the exact result.
TEST(CpuDataPlane, ForwardStopsAtItsGatesAndTheNextForwardIsExact) {
  absl::StatusOr<std::unique_ptr<DataPlane>> formed =
      FormDataPlane(OneRank(PlaneRequest::kGloo), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(formed.ok()) << formed.status();
  DataPlane& plane = **formed;
  ASSERT_TRUE(plane.Allocate(HandOptions(), 0, 0).ok());
  ASSERT_TRUE(plane.LoadExperts(0, core::ExpertSource::Identity(0, 4, 0, 4, 4), 0).ok());
  ASSERT_TRUE(plane.CommitGeometry(1, 2, 2).ok());
  const std::vector<core::bf16_t> hidden = Bf16({1, 2, 3, 4, 0.5f, -1, 2, 8});
  const std::vector<int32_t> ids = {0, 3, 1, -1};
  const std::vector<float> weights = {0.25f, 0.5f, 0.75f, 0.125f};
  std::vector<core::bf16_t> output(8, core::FloatToBf16(-7.0f));

  plane.SetCall(CallBound{absl::Now() - absl::Seconds(1), nullptr});
  absl::StatusOr<core::StepStats> late =
      plane.Forward(0, hidden, ids, weights, 2, absl::MakeSpan(output));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(late.status().message()),
              HasSubstr("Forward (layer 0): before dispatch: stopped on every rank: the call's "
                        "deadline passed on rank(s) [0]"));
  EXPECT_TRUE(IsAgreedStop(late.status()));

  auto checks = std::make_shared<int>(0);
  plane.SetCall(CancelledAtCheck(2, checks));
  absl::StatusOr<core::StepStats> mid =
      plane.Forward(0, hidden, ids, weights, 2, absl::MakeSpan(output));
  EXPECT_EQ(mid.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(std::string(mid.status().message()),
              HasSubstr("Forward (layer 0): between expert compute and combine: stopped on every "
                        "rank: the client cancelled the call on rank(s) [0]"));
  EXPECT_EQ(*checks, 2);
  // Nothing was combined into the output, nothing counted.
  EXPECT_THAT(Floats(output), ::testing::Each(-7.0f));
  absl::StatusOr<core::ExpertLoadCounts> load = plane.ReadExpertLoad(0, false);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->steps, 0);
  EXPECT_THAT(load->tokens_per_expert, ElementsAre(0, 0, 0, 0));

  plane.SetCall(CallBound{});
  absl::StatusOr<core::StepStats> stats =
      plane.Forward(0, hidden, ids, weights, 2, absl::MakeSpan(output));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_THAT(Floats(output), ElementsAre(0.75f, 1.5f, 2.25f, 3.0f, 0.375f, -0.75f, 1.5f, 6.0f));
  load = plane.ReadExpertLoad(0, false);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->steps, 1);
  EXPECT_THAT(load->tokens_per_expert, ElementsAre(1, 1, 0, 1));
}

// Issue 13 item 6 (fuzz-long run 5: a Forward's expert compute outlasted
// its call): two ranks; rank 0's client cancels inside its expert compute
// (check 4: 1 the gate before dispatch, 2 the poll before its one chunk
// of rows, 3 and 4 the polls before each of its two experts), rank 1's
// never. Rank 0 skips its second expert and meets rank 1 at the gate
// between expert compute and combine: both stop there naming rank 0, with
// nothing combined and nothing counted, and the next Forward on the same
// planes equals the one before the stop bit for bit and the dense
// reference.
TEST(CpuDataPlane, TwoRanksStopTogetherWhenOneStopsInsideItsExpertCompute) {
  constexpr int kRanks = 2;
  constexpr int64_t kH = 8, kI = 16, kT = 3;
  constexpr int kExperts = 4;
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::unique_ptr<DataPlane>> planes(kRanks);
  core::EpDispatcherOptions options = HandOptions();
  options.workspace.ep_size = kRanks;
  options.workspace.hidden = kH;
  auto on_ranks = [&](const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    threads.reserve(kRanks);
    for (int r = 0; r < kRanks; ++r) threads.emplace_back(fn, r);
    for (std::thread& t : threads) t.join();
  };
  on_ranks([&](int r) {
    DataPlaneGroup group = OneRank(PlaneRequest::kGloo);
    group.world_size = kRanks;
    group.rank = r;
    absl::StatusOr<std::unique_ptr<DataPlane>> formed = FormDataPlane(group, store);
    ASSERT_TRUE(formed.ok()) << formed.status();
    planes[r] = std::move(*formed);
    ASSERT_TRUE(planes[r]->Allocate(options, 0, 0).ok());
    ASSERT_TRUE(
        planes[r]
            ->LoadExperts(0, core::ExpertSource::Seeded(5, 0, kExperts, 2 * r, 2, kH, kI), 0)
            .ok());
    ASSERT_TRUE(planes[r]->CommitGeometry(1, kT, kT).ok());
  });
  for (const auto& p : planes) ASSERT_NE(p, nullptr);
  // Token t of rank r goes to experts {t, t + 1} (mod 4): each rank gets rows
  // for both of its experts.
  std::vector<std::vector<core::bf16_t>> hidden(kRanks);
  std::vector<std::vector<int32_t>> ids(kRanks);
  std::vector<std::vector<float>> weights(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    for (int64_t i = 0; i < kT * kH; ++i) {
      hidden[r].push_back(core::FloatToBf16(static_cast<float>(std::sin(0.4 * i + r))));
    }
    for (int t = 0; t < kT; ++t) {
      ids[r].push_back((t + r) % kExperts);
      ids[r].push_back((t + r + 1) % kExperts);
      weights[r].push_back(0.75f);
      weights[r].push_back(0.25f);
    }
  }
  const core::bf16_t sentinel = core::FloatToBf16(-7.0f);
  std::vector<std::vector<core::bf16_t>> out(kRanks);
  std::vector<absl::Status> got(kRanks);
  // One Forward on both ranks; rank 0 cancelled from its check `at` (0: never).
  auto forward = [&](int at) {
    on_ranks([&](int r) {
      auto checks = std::make_shared<int>(0);
      planes[r]->SetCall(r == 0 && at > 0 ? CancelledAtCheck(at, checks) : CallBound{});
      out[r].assign(kT * kH, sentinel);
      got[r] =
          planes[r]->Forward(0, hidden[r], ids[r], weights[r], kT, absl::MakeSpan(out[r])).status();
      if (r == 0 && at > 0) {
        EXPECT_EQ(*checks, at) << "no poll after the one that fired";
      }
    });
  };
  forward(0);
  std::vector<std::vector<core::bf16_t>> before = out;
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r];

  forward(4);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kCancelled) << "rank " << r << ": " << got[r];
    EXPECT_TRUE(IsAgreedStop(got[r])) << "rank " << r;
    EXPECT_THAT(std::string(got[r].message()),
                HasSubstr("Forward (layer 0): between expert compute and combine: stopped on "
                          "every rank: the client cancelled the call on rank(s) [0]; nothing was "
                          "committed and the group stays usable"))
        << "rank " << r;
    EXPECT_THAT(out[r], ::testing::Each(sentinel)) << "rank " << r;
    absl::StatusOr<core::ExpertLoadCounts> load = planes[r]->ReadExpertLoad(0, false);
    ASSERT_TRUE(load.ok()) << load.status();
    EXPECT_EQ(load->steps, 1) << "rank " << r << ": only the step before the stop";
  }

  forward(0);
  const absl::StatusOr<core::ExpertSet> all =
      core::ExpertSet::GenerateSwiGlu(5, 0, 0, kExperts, kH, kI);
  ASSERT_TRUE(all.ok());
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r];
    EXPECT_EQ(out[r], before[r]) << "rank " << r;
    std::vector<float> want(kT * kH);
    ASSERT_TRUE(core::DenseMoeReference({&*all}, kExperts, hidden[r], ids[r], weights[r], kT, 2,
                                        absl::MakeSpan(want))
                    .ok());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(core::Bf16ToFloat(out[r][i]), want[i], 0.02f * (1 + std::abs(want[i])))
          << "rank " << r << " element " << i;
    }
    absl::StatusOr<core::ExpertLoadCounts> load = planes[r]->ReadExpertLoad(0, false);
    ASSERT_TRUE(load.ok()) << load.status();
    EXPECT_EQ(load->steps, 2) << "rank " << r;
  }
}

TEST(CheckGpuExpertSource, RefusesWhatTheGpuPlanesDoNotComputeYet) {
  // issue 35: fp8 and mxfp4 sizes the GPU kernels do not step through run
  // on the gloo plane; the GPU planes refuse them instead of loading
  // something else. fp8 at multiples of 128 and mxfp4 at multiples of 64
  // run, and so does Llama-4's input scaling (item 5: the GPU gather
  // scales the rows).
  core::ExpertSource s = core::ExpertSource::Seeded(1, 0, 8, 0, 4, 256, 128);
  EXPECT_TRUE(CheckGpuExpertSource(s).ok());
  s.weight_format = core::quant::ExpertWeightFormat::kFp8Block128;
  EXPECT_TRUE(CheckGpuExpertSource(s).ok());
  s.intermediate = 192;
  absl::Status status = CheckGpuExpertSource(s);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("got hidden 256, intermediate 192"));
  s.intermediate = 160;  // a multiple of the mxfp4 block (32), not of the kernels' K step (64)
  s.weight_format = core::quant::ExpertWeightFormat::kMxfp4;
  status = CheckGpuExpertSource(s);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(),
              ::testing::HasSubstr("mxfp4 experts on a GPU plane need hidden and intermediate "
                                   "multiples of 64, got hidden 256, intermediate 160"));
  s.intermediate = 128;
  EXPECT_TRUE(CheckGpuExpertSource(s).ok());
  s.router_weight_use = core::RouterWeightUse::kScalesInput;
  EXPECT_TRUE(CheckGpuExpertSource(s).ok());
  s.weight_format = core::quant::ExpertWeightFormat::kBf16;
  EXPECT_TRUE(CheckGpuExpertSource(s).ok());
  s.weight_format = core::quant::ExpertWeightFormat::kFp8Block128;
  EXPECT_TRUE(CheckGpuExpertSource(s).ok());
  // Identity experts: e(w x) = w e(x), nothing to refuse.
  EXPECT_TRUE(CheckGpuExpertSource(core::ExpertSource::Identity(0, 8, 0, 4, 256)).ok());
}

}  // namespace
}  // namespace moe_ep::server
