// `moe-ep coordinator status|apply|drain` (issue 31 item 1) against an
// in-process coordinator service on loopback whose targets refuse
// connections (a closed port), and against a server that is no coordinator
// (a worker's health port).

#include "client/service/coordinator_cli.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/group_keeper.h"
#include "client/service/coordinator_service.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/rpc/health.h"
#include "proto/rpc/probe_server.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

TEST(RenderGroupStatus, ShowsPhaseRanksWhyNotReadyAndTheLastEvents) {
  v1::GetGroupResponse g;
  g.set_phase(v1::GROUP_PHASE_WAITING);
  g.set_generation(3);
  g.set_desired_version(2);
  g.set_formations(2);
  g.set_last_form_seconds(0.25);
  const absl::Time now = absl::FromUnixSeconds(1800000000);
  v1::RankView* r0 = g.add_ranks();
  r0->set_rank(0);
  r0->set_target("127.0.0.1:5000");
  r0->set_state(v1::RANK_STATE_WAITING);
  r0->set_worker_state(v1::WORKER_STATE_ALLOCATED);
  r0->set_worker_generation(3);
  r0->set_last_error("in the group of generation 3, waiting for rank 1");
  r0->set_since_unix_ms(absl::ToUnixMillis(now - absl::Seconds(4)));
  v1::RankView* r1 = g.add_ranks();
  r1->set_rank(1);
  r1->set_target("127.0.0.1:5001");
  r1->set_state(v1::RANK_STATE_UNREACHABLE);
  r1->set_last_error("health Watch: UNAVAILABLE: Socket closed");
  for (int i = 0; i < 3; ++i) {
    v1::GroupEvent* e = g.add_history();
    e->set_time_unix_ms(absl::ToUnixMillis(now) - 1000 * (3 - i));
    e->set_generation(3);
    e->set_kind(i == 2 ? "rank_lost" : "formed");
    e->set_rank(i == 2 ? 1 : -1);
    e->set_message(absl::StrCat("event ", i));
  }
  const std::string text = RenderGroupStatus("127.0.0.1:50070", g, 2, now);
  EXPECT_THAT(text, HasSubstr("coordinator 127.0.0.1:50070: phase WAITING, generation 3, desired "
                              "state version 2, 2 ranks\n"));
  EXPECT_THAT(text, HasSubstr("formations 2, failed attempts 0; last formation 0.25 s"));
  EXPECT_THAT(text,
              HasSubstr("   0  127.0.0.1:5000  WAITING      gen 3 ALLOCATED  4.0 s  in the group"));
  EXPECT_THAT(text, HasSubstr("waiting for rank 1"));
  EXPECT_THAT(text,
              HasSubstr("   1  127.0.0.1:5001  UNREACHABLE  -                    -  health Watch"));
  // The newest 2 of 3 events, oldest first, with their UTC times.
  EXPECT_THAT(text, ::testing::Not(HasSubstr("event 0")));
  EXPECT_THAT(text, HasSubstr("2027-01-15 07:59:59.000  gen 3  rank_lost rank 1: event 2\n"));
  EXPECT_LT(text.find("event 1"), text.find("event 2"));
}

// A coordinator service on loopback (a GroupKeeper whose ranks refuse
// connections: 127.0.0.1:9, the discard port, is closed on test machines).
class CoordinatorCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GroupKeeperOptions options;
    options.probe_interval = absl::Milliseconds(50);
    auto keeper = GroupKeeper::Start(options);
    ASSERT_TRUE(keeper.ok()) << keeper.status();
    keeper_ = std::move(*keeper);
    service_ = std::make_unique<CoordinatorService>(keeper_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    options_.target = absl::StrCat("127.0.0.1:", port);
    state_file_ = absl::StrCat(::testing::TempDir(), "/coordinator-cli-", getpid(), ".json");
    std::ofstream(state_file_) << R"({"targets": ["127.0.0.1:9"], "backend": "gloo",
                                      "experts": {"kind": "EXPERT_KIND_IDENTITY"}})";
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now());
    keeper_.reset();
    std::remove(state_file_.c_str());
  }

  CoordinatorClientOptions options_;
  std::string state_file_;
  std::unique_ptr<GroupKeeper> keeper_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(CoordinatorCliTest, ApplyStatusAndDrainTalkToTheCoordinator) {
  std::ostringstream status;
  ASSERT_TRUE(RunCoordinatorStatus(options_, status).ok());
  EXPECT_THAT(status.str(), HasSubstr("phase UNSPECIFIED, generation 0, desired state version 0, "
                                      "0 ranks"));

  options_.state_file = state_file_;
  std::ostringstream applied;
  ASSERT_TRUE(RunCoordinatorApply(options_, applied).ok());
  EXPECT_THAT(applied.str(), HasSubstr("desired state version 1; the group is formed anew"));
  std::ostringstream again;
  ASSERT_TRUE(RunCoordinatorApply(options_, again).ok());
  EXPECT_THAT(again.str(), HasSubstr("unchanged: "));
  EXPECT_THAT(again.str(), HasSubstr("(version 1)"));

  // The rank that refuses connections shows as UNREACHABLE, with why.
  std::string text;
  for (int i = 0; i < 400; ++i) {  // up to 20 s on a loaded machine
    std::ostringstream out;
    ASSERT_TRUE(RunCoordinatorStatus(options_, out).ok());
    text = out.str();
    if (text.find("UNREACHABLE") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_THAT(text, HasSubstr("desired state version 1, 1 ranks"));
  EXPECT_THAT(text, HasSubstr("   0  127.0.0.1:9  UNREACHABLE"));
  EXPECT_THAT(text, HasSubstr("  gen 0  applied: desired state version 1\n"));

  options_.json = true;
  std::ostringstream json;
  ASSERT_TRUE(RunCoordinatorStatus(options_, json).ok());
  const nlohmann::json j = nlohmann::json::parse(json.str());
  EXPECT_EQ(j["desired_version"], 1);
  EXPECT_EQ(j["desired"]["targets"], nlohmann::json::array({"127.0.0.1:9"}));
  EXPECT_EQ(j["ranks"][0]["state"], "RANK_STATE_UNREACHABLE");
  EXPECT_TRUE(j.contains("masked_ranks"));

  options_.json = false;
  std::ostringstream drained;
  ASSERT_TRUE(RunCoordinatorDrain(options_, drained).ok());
  EXPECT_THAT(drained.str(), HasSubstr("drained, but 1 rank(s) could not be reached to leave:\n"
                                       "  rank 0 (127.0.0.1:9): UNAVAILABLE"));
  std::ostringstream after;
  ASSERT_TRUE(RunCoordinatorStatus(options_, after).ok());
  EXPECT_THAT(after.str(), HasSubstr("phase DRAINED"));
}

TEST_F(CoordinatorCliTest, RefusalsNameTheFieldOrWhatServesThere) {
  options_.state_file = state_file_ + ".missing";
  std::ostringstream out;
  EXPECT_EQ(RunCoordinatorApply(options_, out).code(), absl::StatusCode::kNotFound);
  // A state the coordinator refuses: INVALID_ARGUMENT naming the field.
  std::ofstream(state_file_) << R"({"targets": ["127.0.0.1:9"], "layers": -1})";
  options_.state_file = state_file_;
  const absl::Status bad = RunCoordinatorApply(options_, out);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_THAT(bad.message(), HasSubstr("Coordinator.Apply on " + options_.target));
  EXPECT_THAT(bad.message(), HasSubstr("layers"));

  // A server that is no coordinator (a worker's plaintext health port).
  rpc::EnableDefaultHealthService();
  grpc::CallbackGenericService unimplemented;
  int port = 0;
  auto probe = rpc::StartProbeServer("127.0.0.1:0", &unimplemented, &port);
  ASSERT_TRUE(probe.ok()) << probe.status();
  std::unique_ptr<grpc::Server> other = std::move(*probe);
  CoordinatorClientOptions o;
  o.target = absl::StrCat("127.0.0.1:", port);
  const absl::Status not_one = RunCoordinatorStatus(o, out);
  EXPECT_EQ(not_one.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(not_one.message(), HasSubstr(o.target +
                                           " serves no moe_ep.v1.Coordinator (a "
                                           "worker? use `moe-ep status --targets " +
                                           o.target));
  other->Shutdown(std::chrono::system_clock::now());
  o.target = "";
  EXPECT_EQ(RunCoordinatorStatus(o, out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::client
