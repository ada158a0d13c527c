// The group, memory and coordinator parts of `moe-ep status` (issue 31 item
// 1); the rest of the table: tests/client/commands_test.cc.

#include "client/status_command.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::GetStatusResponse Allocated(int64_t generation) {
  v1::GetStatusResponse s;
  s.set_rank(1);
  s.set_world_size(4);
  s.set_generation(generation);
  s.set_state(v1::WORKER_STATE_ALLOCATED);
  return s;
}

TEST(GroupState, SaysWhatGetStatusSaysOfTheGroup) {
  v1::GetStatusResponse s;
  s.set_state(v1::WORKER_STATE_STARTED);
  EXPECT_EQ(GroupState(s), "none");
  EXPECT_EQ(GroupCell(s), "-");
  s.set_state(v1::WORKER_STATE_CONFIGURED);
  s.set_generation(2);
  EXPECT_EQ(GroupState(s), "forming");
  EXPECT_EQ(GroupCell(s), "gen 2 forming");
  s = Allocated(3);
  EXPECT_EQ(GroupState(s), "ready");
  EXPECT_EQ(GroupCell(s), "gen 3 ready");
  s.add_masked_ranks(2);
  s.add_masked_ranks(3);
  EXPECT_EQ(GroupState(s), "masked");
  EXPECT_EQ(GroupCell(s), "gen 3 masked [2,3]");
  s.set_group_broken(true);  // broken wins over masked: nothing is served
  EXPECT_EQ(GroupState(s), "broken");
  EXPECT_EQ(GroupCell(s), "gen 3 BROKEN");
}

TEST(MemoryCell, IsWhatTheWorkerHoldsAgainstItsOwnCap) {
  v1::GetStatusResponse s = Allocated(1);
  s.set_device_memory_bytes(int64_t{64} << 30);  // the machine's RAM: not shown
  s.set_workspace_bytes(1 << 20);
  s.set_expert_bytes(3 << 20);
  s.set_memory_cap_bytes(int64_t{12} << 30);
  EXPECT_EQ(MemoryCell(s), "4.00 MiB / 12.0 GiB");
  s.set_memory_cap_bytes(0);
  EXPECT_EQ(MemoryCell(s), "4.00 MiB / uncapped");
}

TEST(RenderWorkerTable, ShowsTheGroupColumnAndTheCapNotTheMachinesMemory) {
  v1::GetStatusResponse ready = Allocated(5);
  ready.set_device_memory_bytes(int64_t{64} << 30);
  ready.set_memory_cap_bytes(int64_t{48} << 30);
  ready.set_workspace_bytes(2048);
  v1::GetStatusResponse masked = ready;
  masked.set_rank(2);
  masked.add_masked_ranks(0);
  const std::string text = RenderWorkerTable({"127.0.0.1:1", "127.0.0.1:2"}, {ready, masked});
  EXPECT_THAT(text, HasSubstr("state      group"));
  EXPECT_THAT(text, HasSubstr("ALLOCATED  gen 5 ready"));
  EXPECT_THAT(text, HasSubstr("ALLOCATED  gen 5 masked [0]"));
  EXPECT_THAT(text, HasSubstr("2.00 KiB / 48.0 GiB"));
  EXPECT_THAT(text, Not(HasSubstr("64.0 GiB")));
}

// --json carries every GetStatusResponse field under its proto name, by
// the message's own descriptor, so a field added to the .proto is covered.
TEST(WorkerStatusJson, CarriesEveryGetStatusField) {
  v1::GetStatusResponse s = Allocated(7);
  s.set_capacity_tokens(384);
  s.set_memory_cap_bytes(int64_t{5} << 40);  // beyond 32 bits: still an integer
  s.set_workspace_bytes(100);
  s.set_expert_bytes(23);
  s.add_masked_ranks(3);
  s.set_mask_round(1);
  s.mutable_counters()->set_forwards(9);
  const nlohmann::json j = WorkerStatusJson({"h:1"}, {s})[0];
  const google::protobuf::Descriptor* d = v1::GetStatusResponse::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    EXPECT_TRUE(j.contains(d->field(i)->name())) << d->field(i)->name();
  }
  EXPECT_EQ(j["generation"], 7);
  EXPECT_EQ(j["capacity_tokens"], 384);
  EXPECT_EQ(j["memory_cap_bytes"].get<int64_t>(), int64_t{5} << 40);
  EXPECT_TRUE(j["memory_cap_bytes"].is_number_integer());
  EXPECT_EQ(j["masked_ranks"], nlohmann::json::array({3}));
  EXPECT_EQ(j["mask_round"], 1);
  EXPECT_EQ(j["group"], "masked");
  EXPECT_EQ(j["memory_used_bytes"], 123);
  EXPECT_EQ(j["state"], "ALLOCATED");  // the short name, as before
  EXPECT_EQ(j["forwards"], 9);
  EXPECT_EQ(j["counters"]["forwards"], 9);
  EXPECT_EQ(j["lease_owner"], "");  // unset fields are there too
}

TEST(ExplainUnimplemented, NamesACoordinatorAndTheCommandToUse) {
  v1::GetGroupResponse group;
  group.set_phase(v1::GROUP_PHASE_READY);
  group.set_generation(3);
  group.add_ranks()->set_rank(0);
  group.add_ranks()->set_rank(1);
  const absl::Status empty = absl::UnimplementedError("");
  const absl::Status coordinator = ExplainUnimplemented(empty, "127.0.0.1:50070", &group);
  EXPECT_EQ(coordinator.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(coordinator.message(),
            "this is a coordinator (moe_ep.v1.Coordinator: phase GROUP_PHASE_READY, generation "
            "3, 2 ranks), not a worker: use `moe-ep coordinator status --target "
            "127.0.0.1:50070`");
  const absl::Status other = ExplainUnimplemented(empty, "127.0.0.1:80", nullptr);
  EXPECT_THAT(other.message(), HasSubstr("127.0.0.1:80 serves no moe_ep.v1.Worker"));
  EXPECT_EQ(DescribeWorkerError(other, {}).state, "NOT_A_WORKER");
  const std::string table = RenderWorkerTable({"127.0.0.1:50070"}, {coordinator});
  EXPECT_THAT(table, HasSubstr("NOT_A_WORKER"));
  EXPECT_THAT(table, HasSubstr("this is a coordinator"));
}

}  // namespace
}  // namespace moe_ep::client
