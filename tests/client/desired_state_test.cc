#include "client/desired_state.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

v1::DesiredState TwoTargets() {
  v1::DesiredState s;
  s.add_targets("127.0.0.1:5001");
  s.add_targets("127.0.0.1:5002");
  return s;
}

TEST(ParseDesiredStateJson, ReadsTheProtoJsonForm) {
  auto s = ParseDesiredStateJson(R"({"headless_service": {"service": "moe-ep-worker",
      "replicas": 2, "port": 50051}, "model": "qwen3-30b-a3b", "layers": 2,
      "experts": {"kind": "EXPERT_KIND_IDENTITY"}, "groupTimeoutMs": "9000"})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->headless_service().replicas(), 2);
  EXPECT_EQ(s->layers(), 2);
  EXPECT_EQ(s->experts().kind(), v1::EXPERT_KIND_IDENTITY);
  EXPECT_EQ(s->group_timeout_ms(), 9000);
}

TEST(ParseDesiredStateJson, UnknownFieldIsInvalidArgument) {
  auto s = ParseDesiredStateJson(R"({"tragets": ["127.0.0.1:1"]})");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("tragets"), std::string::npos) << s.status();
}

TEST(ParseDesiredStateJson, EnumsAsTheCliSpellsThem) {
  // Issue 31 item 7: "swiglu" as `moe-ep run --experts swiglu` says it; the
  // proto's names still work; camelCase keys of nested messages too.
  for (const char* kind : {"swiglu", "SwiGLU", "EXPERT_KIND_SWIGLU"}) {
    auto s =
        ParseDesiredStateJson(absl::StrCat(R"({"targets": ["127.0.0.1:1"], "experts": {"kind": ")",
                                           kind, R"("}, "dispatchDtype": "fp8_e4m3"})"));
    ASSERT_TRUE(s.ok()) << kind << ": " << s.status();
    EXPECT_EQ(s->experts().kind(), v1::EXPERT_KIND_SWIGLU) << kind;
    EXPECT_EQ(s->dispatch_dtype(), v1::DISPATCH_DTYPE_FP8_E4M3) << kind;
  }
  auto identity =
      ParseDesiredStateJson(R"({"experts": {"kind": "identity"}, "dispatch_dtype": "bf16"})");
  ASSERT_TRUE(identity.ok()) << identity.status();
  EXPECT_EQ(identity->experts().kind(), v1::EXPERT_KIND_IDENTITY);
  EXPECT_EQ(identity->dispatch_dtype(), v1::DISPATCH_DTYPE_BF16);
  // Neither spelling: the parser's error, naming the value.
  auto relu = ParseDesiredStateJson(R"({"experts": {"kind": "relu"}})");
  EXPECT_EQ(relu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(relu.status().message().find("relu"), std::string::npos) << relu.status();
  // Not JSON at all: still the parser's message.
  auto broken = ParseDesiredStateJson("{\"experts\": ");
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExampleDesiredStateJson, IsAValidDesiredState) {
  auto s = ParseDesiredStateJson(ExampleDesiredStateJson());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(ValidateDesiredState(*s).ok()) << ValidateDesiredState(*s);
  EXPECT_EQ(s->targets_size(), 2);
  EXPECT_EQ(s->experts().kind(), v1::EXPERT_KIND_SWIGLU);
  EXPECT_EQ(s->layers(), 2);
  const std::string help = DesiredStateHelp();
  EXPECT_NE(help.find(ExampleDesiredStateJson()), std::string::npos);
  EXPECT_NE(help.find("headless_service"), std::string::npos);
}

TEST(WithDefaults, FillsTheMainJobDefaults) {
  v1::DesiredState s;
  s.mutable_headless_service()->set_service("moe-ep-worker.default.svc");
  const v1::DesiredState d = WithDefaults(s);
  EXPECT_EQ(d.backend(), "gloo");
  EXPECT_EQ(d.model(), "qwen3-30b-a3b");
  EXPECT_EQ(d.layers(), 3);
  EXPECT_EQ(d.capacity_tokens(), 384);
  EXPECT_EQ(d.dispatch_dtype(), v1::DISPATCH_DTYPE_BF16);
  EXPECT_EQ(d.experts().kind(), v1::EXPERT_KIND_SWIGLU);
  EXPECT_EQ(d.group_timeout_ms(), 30000);
  EXPECT_EQ(d.headless_service().procs_per_pod(), 1);
  EXPECT_EQ(d.headless_service().pod_prefix(), "moe-ep-worker");
}

TEST(SameDesiredState, ComparesAfterDefaults) {
  v1::DesiredState a = TwoTargets();
  v1::DesiredState b = TwoTargets();
  b.set_layers(3);  // the default spelled out
  EXPECT_TRUE(SameDesiredState(a, b));
  b.set_layers(2);
  EXPECT_FALSE(SameDesiredState(a, b));
}

TEST(ValidateDesiredState, NeedsExactlyOneWayToFindTheRanks) {
  v1::DesiredState neither;
  EXPECT_EQ(ValidateDesiredState(neither).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ValidateDesiredState(neither).message().find("neither"), std::string::npos);
  v1::DesiredState both = TwoTargets();
  both.mutable_headless_service()->set_service("w");
  EXPECT_NE(ValidateDesiredState(both).message().find("both"), std::string::npos);
}

TEST(ValidateDesiredState, NamesTheBadField) {
  v1::DesiredState s = TwoTargets();
  s.add_targets("127.0.0.1:5001");
  EXPECT_NE(ValidateDesiredState(s).message().find("targets[2]"), std::string::npos);
  s = TwoTargets();
  s.set_backend("mpi");
  EXPECT_NE(ValidateDesiredState(s).message().find("backend"), std::string::npos);
  s = TwoTargets();
  s.set_layers(49);  // qwen3-30b-a3b: 48 sparse layers
  const absl::Status layers = ValidateDesiredState(s);
  EXPECT_EQ(layers.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layers.message().find("48 sparse layers, asked for 49"), std::string::npos) << layers;
  s = TwoTargets();
  s.set_model("no-such-model");
  EXPECT_NE(ValidateDesiredState(s).message().find("model"), std::string::npos);
  v1::DesiredState h;
  h.mutable_headless_service()->set_service("w");
  h.mutable_headless_service()->set_replicas(2);
  h.mutable_headless_service()->set_port(70000);
  EXPECT_NE(ValidateDesiredState(h).message().find("headless_service.port"), std::string::npos);
}

TEST(BuildGroupRequests, MainJobLayoutOfQwen3) {
  v1::DesiredState s = TwoTargets();
  s.set_layers(2);
  s.mutable_experts()->set_seed(5);
  auto r = BuildGroupRequests(s, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->configure.layout().tp_size(), 4);
  EXPECT_EQ(r->configure.layout().attn_dp_size(), 4);
  EXPECT_EQ(r->configure.layout().moe_dense_tp_size(), 1);
  EXPECT_TRUE(r->configure.a2a_enabled());
  // qwen3-30b-a3b: H 2048, 48 layers, all sparse, 128 experts, top-8, I 768.
  EXPECT_EQ(r->configure.model().hidden_size(), 2048);
  EXPECT_EQ(r->configure.model().sparse_layers_size(), 48);
  EXPECT_EQ(r->allocate.hidden_size(), 2048);
  EXPECT_EQ(r->allocate.top_k(), 8);
  EXPECT_EQ(r->allocate.num_experts(), 128);
  EXPECT_EQ(r->allocate.capacity_tokens(), 384);
  EXPECT_EQ(r->allocate.dispatch_dtype(), v1::DISPATCH_DTYPE_BF16);
  ASSERT_EQ(r->load.size(), 2u);
  EXPECT_EQ(r->load[0].layer(), 0);
  EXPECT_EQ(r->load[1].layer(), 1);
  EXPECT_EQ(r->load[1].seed(), 5u);
  EXPECT_EQ(r->load[1].kind(), v1::EXPERT_KIND_SWIGLU);
  EXPECT_EQ(r->load[1].intermediate_size(), 768);
  EXPECT_FALSE(r->load[1].has_shared_expert());
}

TEST(BuildGroupRequests, MoreRanksThanExpertsIsInvalidArgument) {
  auto r = BuildGroupRequests(TwoTargets(), 129);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("128 experts, fewer than the 129 ranks"), std::string::npos)
      << r.status();
}

// qwen3-30b-a3b's 128 experts on 4 ranks with 2 redundant slots a rank:
// rank r holds experts 32r..32r+31 and replicas of the next rank's first two.
v1::DesiredState RedundantState() {
  v1::DesiredState s = TwoTargets();
  s.set_layers(2);
  s.set_redundant_slots_per_rank(2);
  for (int r = 0; r < 4; ++r) {
    v1::PlacementRank* rank = s.add_placement();
    for (int e = 0; e < 32; ++e) rank->add_slot_experts(32 * r + e);
    rank->add_slot_experts((32 * (r + 1)) % 128);
    rank->add_slot_experts((32 * (r + 1) + 1) % 128);
  }
  return s;
}

TEST(BuildGroupRequests, InstallsThePlacementOnEveryRunLayer) {
  auto r = BuildGroupRequests(RedundantState(), 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->allocate.redundant_slots_per_rank(), 2);
  ASSERT_EQ(r->placements.size(), 2u);
  EXPECT_EQ(r->placements[0].layer(), 0);
  EXPECT_EQ(r->placements[1].layer(), 1);
  ASSERT_EQ(r->placements[1].ranks_size(), 4);
  EXPECT_EQ(r->placements[1].ranks(3).slot_experts_size(), 34);
  EXPECT_EQ(r->placements[1].ranks(3).slot_experts(32), 0);  // rank 0's first expert again
  // Expert 32 has replicas on ranks 1 (slot 0) and 0 (slot 32).
  auto table = DesiredPlacement(RedundantState(), 128, 4);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_TRUE(table->has_value());
  EXPECT_EQ((*table)->Replicas(32).size(), 2u);
  EXPECT_EQ(r->placements[0].fingerprint(), (*table)->Fingerprint());
  EXPECT_TRUE(BuildGroupRequests(TwoTargets(), 4)->placements.empty());
}

TEST(BuildGroupRequests, PlacementErrorsNameTheField) {
  v1::DesiredState s = RedundantState();
  s.mutable_placement(1)->add_slot_experts(5);
  auto r = BuildGroupRequests(s, 4);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("placement[1].slot_experts: expected 34 slots"),
            std::string::npos)
      << r.status();
  r = BuildGroupRequests(RedundantState(), 2);
  EXPECT_NE(r.status().message().find("placement: expected one entry per rank (2), got 4"),
            std::string::npos)
      << r.status();
  s = RedundantState();
  s.mutable_placement(2)->set_slot_experts(0, 200);
  r = BuildGroupRequests(s, 4);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("placement: "), std::string::npos) << r.status();
  s = TwoTargets();
  s.set_redundant_slots_per_rank(2);
  const absl::Status v = ValidateDesiredState(s);
  EXPECT_EQ(v.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.message().find("placement: redundant_slots_per_rank is 2"), std::string::npos) << v;
}

}  // namespace
}  // namespace moe_ep::client
