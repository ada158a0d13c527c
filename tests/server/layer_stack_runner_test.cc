#include "server/layer_stack_runner.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

v1::ModelDescription Model() {
  v1::ModelDescription m;
  m.set_name("m");
  m.set_hidden_size(32);
  m.set_num_layers(3);
  m.set_num_experts(8);
  m.set_top_k(2);
  m.set_moe_intermediate_size(16);
  return m;
}

const core::ParallelLayout kLayout{2, 2, 0};
const std::vector<bool> kSparse = {false, true, true};

TEST(ResolveLayerStackConfig, ZeroFieldsTakeTheModelsAndDefaults) {
  v1::LayerStackSpec spec;
  spec.set_dense_intermediate_size(64);
  spec.set_seed(9);
  auto c = ResolveLayerStackConfig(spec, kLayout, kSparse, true, Model());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden, 32);
  EXPECT_EQ(c->moe_intermediate, 16);
  EXPECT_EQ(c->dense_intermediate, 64);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->top_k, 2);
  EXPECT_EQ(c->seed, 9u);
  EXPECT_FLOAT_EQ(c->rms_eps, 1e-6f);
  EXPECT_EQ(c->capacity_tokens, kDefaultStackCapacityTokens);
  EXPECT_EQ(c->sparse_layers, kSparse);
  EXPECT_TRUE(c->a2a_enabled);
  EXPECT_EQ(c->layout.attn_dp_size, 2);
}

TEST(ResolveLayerStackConfig, NumLayersTakesTheFirstConfiguredLayers) {
  v1::LayerStackSpec spec;
  spec.set_num_layers(2);
  spec.set_dense_intermediate_size(64);
  auto c = ResolveLayerStackConfig(spec, kLayout, kSparse, false, Model());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{false, true}));
  EXPECT_FALSE(c->a2a_enabled);
}

TEST(ResolveLayerStackConfig, AllSparseNeedsNoDenseSize) {
  v1::LayerStackSpec spec;
  auto c = ResolveLayerStackConfig(spec, kLayout, {true, true}, true, Model());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->dense_intermediate, 2);  // tp_size, unused
}

TEST(ResolveLayerStackConfig, ErrorsNameTheField) {
  struct Case {
    std::function<void(v1::LayerStackSpec&, v1::ModelDescription&)> mutate;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {[](auto& s, auto&) { s.set_num_layers(4); },
       "stack.num_layers: expected in [0, 3] (0 = all configured layers), got 4"},
      {[](auto& s, auto&) { s.set_hidden_size(48); },
       "stack.hidden_size: expected 32 (the configured model.hidden_size) or 0, got 48"},
      {[](auto&, auto& m) { m.set_hidden_size(0); },
       "stack.hidden_size: required (the configured model has no hidden_size)"},
      {[](auto& s, auto&) { s.set_dense_intermediate_size(0); },
       "stack.dense_intermediate_size: required"},
      {[](auto& s, auto&) { s.set_dense_intermediate_size(63); }, "dense_intermediate"},
      {[](auto& s, auto& m) {
         m.set_num_experts(0);
         s.set_num_experts(1);
       },
       "num_experts"},  // fewer experts than ranks
      {[](auto& s, auto&) { s.set_top_k(-1); }, "stack.top_k: expected in [0, 65536], got -1"},
      {[](auto& s, auto&) { s.set_rms_eps(-1.0f); }, "stack.rms_eps: expected >= 0"},
      {[](auto& s, auto&) { s.set_capacity_tokens(-2); }, "stack.capacity_tokens"},
      {[](auto& s, auto&) { s.set_hidden_size(int64_t{1} << 21); }, "stack.hidden_size"},
  };
  for (const Case& c : cases) {
    v1::LayerStackSpec spec;
    spec.set_dense_intermediate_size(64);
    v1::ModelDescription model = Model();
    c.mutate(spec, model);
    auto r = ResolveLayerStackConfig(spec, kLayout, kSparse, true, model);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.fragment;
    EXPECT_THAT(r.status().message(), HasSubstr(c.fragment));
  }
}

TEST(LayerStackRunner, RunBeforeConfigureIsFailedPrecondition) {
  LayerStackRunner runner;
  EXPECT_FALSE(runner.configured());
  // A collective that fails every call: Run must not reach it.
  class NoCollective final : public core::ControlCollective {
   public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    std::string backend() const override { return "none"; }
    absl::Status AllToAllV(const void*, absl::Span<const int64_t>, void*,
                           absl::Span<const int64_t>) override {
      return absl::InternalError("unexpected");
    }
    absl::Status AllGather(const void*, int64_t, void*) override {
      return absl::InternalError("unexpected");
    }
    absl::Status AllReduceSum(float*, int64_t) override {
      return absl::InternalError("unexpected");
    }
    absl::Status Barrier() override { return absl::InternalError("unexpected"); }
    void SetCallDeadline(absl::Time) override {}
    absl::StatusOr<std::unique_ptr<core::ControlCollective>> Split(absl::Span<const int>,
                                                                   const std::string&) override {
      return absl::InternalError("unexpected");
    }
  } world;
  v1::ForwardLayersResponse response;
  absl::Status s = runner.Run(
      world, 1,
      [](const absl::Status&, const std::vector<core::BallotField>&) {
        return absl::InternalError("unexpected");
      },
      v1::ForwardLayersRequest(), 0, 0, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("ConfigureLayers first"));
  runner.Configure(kLayout, kSparse, true, Model());
  EXPECT_TRUE(runner.configured());
  runner.Reset();
  EXPECT_FALSE(runner.configured());
  EXPECT_EQ(runner.held_bytes(), 0);
}

}  // namespace
}  // namespace moe_ep::server
