#include "client/proto_json.h"

#include "gtest/gtest.h"
#include "moe_ep/v1/coordinator.pb.h"
#include "moe_ep/v1/tensor.pb.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::client {
namespace {

TEST(ProtoToJson, EveryFieldByProtoNameIntegersAsNumbersEnumsByName) {
  moe_ep::v1::GetGroupResponse g;
  g.set_phase(moe_ep::v1::GROUP_PHASE_MASKED);
  g.set_generation(int64_t{1} << 40);
  g.add_masked_ranks(2);
  g.set_last_form_seconds(0.5);
  moe_ep::v1::RankView* r = g.add_ranks();
  r->set_rank(1);
  r->set_state(moe_ep::v1::RANK_STATE_WAITING);
  r->set_worker_state(moe_ep::v1::WORKER_STATE_ALLOCATED);
  const nlohmann::json j = ProtoToJson(g);
  const google::protobuf::Descriptor* d = moe_ep::v1::GetGroupResponse::descriptor();
  ASSERT_EQ(j.size(), static_cast<size_t>(d->field_count()));
  for (int i = 0; i < d->field_count(); ++i) EXPECT_TRUE(j.contains(d->field(i)->name()));
  EXPECT_EQ(j["phase"], "GROUP_PHASE_MASKED");
  EXPECT_TRUE(j["generation"].is_number_integer());
  EXPECT_EQ(j["generation"].get<int64_t>(), int64_t{1} << 40);
  EXPECT_EQ(j["masked_ranks"], nlohmann::json::array({2}));
  EXPECT_DOUBLE_EQ(j["last_form_seconds"].get<double>(), 0.5);
  EXPECT_EQ(j["history"], nlohmann::json::array());
  ASSERT_EQ(j["ranks"].size(), 1u);
  EXPECT_EQ(j["ranks"][0]["state"], "RANK_STATE_WAITING");
  EXPECT_EQ(j["ranks"][0]["worker_state"], "WORKER_STATE_ALLOCATED");
  EXPECT_EQ(j["ranks"][0]["last_error"], "");
  // An unset message field: its defaults, every field there.
  EXPECT_EQ(j["desired"]["layers"], 0);
  EXPECT_EQ(j["desired"]["targets"], nlohmann::json::array());
  EXPECT_EQ(j["desired"]["experts"]["kind"], "EXPERT_KIND_UNSPECIFIED");
}

TEST(ProtoToJson, BytesAreBase64AndInvalidUtf8IsReplaced) {
  moe_ep::v1::Tensor t;
  t.set_data(std::string("\x00\x01\xff", 3));
  EXPECT_EQ(ProtoToJson(t)["data"], "AAH/");
  moe_ep::v1::GetStatusResponse s;
  s.set_broken_reason(std::string("bad \xff byte"));
  EXPECT_NO_THROW((void)ProtoToJson(s).dump());
}

}  // namespace
}  // namespace moe_ep::client
