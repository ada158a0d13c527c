// The shared expert (core/shared_expert.h) and its combine term in the CPU
// dispatcher (core/ep_dispatcher.h), with hand-worked values (issue 18).

#include "core/shared_expert.h"

#include <cmath>
#include <vector>

#include "core/ep_dispatcher.h"
#include "core/moe_reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::HasSubstr;

std::vector<bf16_t> Bf16(const std::vector<float>& v) {
  std::vector<bf16_t> out;
  out.reserve(v.size());
  for (float f : v) out.push_back(FloatToBf16(f));
  return out;
}

TEST(StableSigmoid, HandWorkedValues) {
  EXPECT_EQ(StableSigmoid(0.0f), 0.5f);
  // 1 / (1 + e^30) = 9.357622968840175e-14; e^-30 is below float's epsilon
  // relative to 1, so sigmoid(30) rounds to exactly 1.
  EXPECT_NEAR(StableSigmoid(-30.0f), 9.357622968840175e-14, 1e-19);
  EXPECT_EQ(StableSigmoid(30.0f), 1.0f);
  EXPECT_NEAR(StableSigmoid(-200.0f), 0.0f, 1e-38);  // no overflow to NaN
}

// gate [0.5, -0.5] and x = [2, 2]: the logit is 0, so g = 0.5 and an
// identity shared expert gives bf16(0.5 * x) = [1, 1].
TEST(SharedExpert, GateLogitZeroHalvesTheOutput) {
  auto shared = SharedExpert::IdentityWithGate(Bf16({0.5f, -0.5f}), 2);
  ASSERT_TRUE(shared.ok()) << shared.status();
  const std::vector<bf16_t> x = Bf16({2.0f, 2.0f});
  std::vector<float> g(1);
  ASSERT_TRUE(shared->GateValues(x, 1, absl::MakeSpan(g)).ok());
  EXPECT_EQ(g[0], 0.5f);
  std::vector<bf16_t> out(2);
  ASSERT_TRUE(shared->Compute(x, 1, absl::MakeSpan(out)).ok());
  EXPECT_EQ(Bf16ToFloat(out[0]), 1.0f);
  EXPECT_EQ(Bf16ToFloat(out[1]), 1.0f);
}

// gate [15, 15], x = [1, 1] -> logit 30 -> g = 1: out = x. With x = [-1, -1]
// the logit is -30: g = 9.3576e-14, and out = bf16(g * -1).
TEST(SharedExpert, GateLogitPlusMinusThirty) {
  auto shared = SharedExpert::IdentityWithGate(Bf16({15.0f, 15.0f}), 2);
  ASSERT_TRUE(shared.ok());
  std::vector<bf16_t> out(4);
  ASSERT_TRUE(shared->Compute(Bf16({1.0f, 1.0f, -1.0f, -1.0f}), 2, absl::MakeSpan(out)).ok());
  EXPECT_EQ(Bf16ToFloat(out[0]), 1.0f);
  EXPECT_EQ(Bf16ToFloat(out[1]), 1.0f);
  const float tiny = Bf16ToFloat(FloatToBf16(-9.357622968840175e-14f));
  EXPECT_EQ(Bf16ToFloat(out[2]), tiny);
  EXPECT_EQ(Bf16ToFloat(out[3]), tiny);
  EXPECT_LT(std::fabs(tiny + 9.3576e-14f), 1e-15f);
}

// A SwiGLU with I = 1, H = 2: gate row [1, 0], up row [0, 1], down column
// [1, 2]. For x = [1, 2]: silu(1) * 2 = 2 / (1 + e^-1) = 1.4621172, so
// shared(x) = [1.4621172, 2.9242344]; no gate.
TEST(SharedExpert, SwiGluHandWorked) {
  SwiGluWeights w;
  w.gate = Bf16({1.0f, 0.0f});
  w.up = Bf16({0.0f, 1.0f});
  w.down = Bf16({1.0f, 2.0f});
  auto shared = SharedExpert::FromWeights(w, {}, 2, 1);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_FALSE(shared->has_gate());
  EXPECT_EQ(shared->weight_bytes(), 3 * 2 * 2);
  std::vector<float> out(2);
  ASSERT_TRUE(shared->ComputeFloat(Bf16({1.0f, 2.0f}), 1, absl::MakeSpan(out)).ok());
  EXPECT_NEAR(out[0], 1.4621172f, 1e-6);
  EXPECT_NEAR(out[1], 2.9242344f, 1e-6);
}

TEST(SharedExpert, SeededIsDeterministicAndDistinctFromRoutedExpertZero) {
  auto a = SharedExpert::Generate(7, 3, 16, 8, true);
  auto b = SharedExpert::Generate(7, 3, 16, 8, true);
  auto routed = ExpertSet::GenerateSwiGlu(7, 3, 0, 1, 16, 8);
  ASSERT_TRUE(a.ok() && b.ok() && routed.ok());
  EXPECT_EQ(a->experts().swiglu_weights(0).gate, b->experts().swiglu_weights(0).gate);
  EXPECT_EQ(a->gate(), b->gate());
  EXPECT_EQ(a->gate().size(), 16u);
  EXPECT_NE(a->experts().swiglu_weights(0).gate, routed->swiglu_weights(0).gate);
  auto other_layer = SharedExpert::Generate(7, 4, 16, 8, true);
  ASSERT_TRUE(other_layer.ok());
  EXPECT_NE(a->gate(), other_layer->gate());
}

TEST(SharedExpert, RejectsBadShapes) {
  auto bad_gate = SharedExpert::IdentityWithGate(Bf16({1.0f}), 2);
  EXPECT_EQ(bad_gate.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_gate.status().message(), HasSubstr("gate"));
  auto shared = SharedExpert::Identity(0, 0, 2, false);
  ASSERT_TRUE(shared.ok());
  std::vector<bf16_t> out(3);
  EXPECT_EQ(shared->Compute(Bf16({1, 2, 3, 4}), 2, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  // Zero tokens: nothing to compute, and no error.
  std::vector<bf16_t> none;
  EXPECT_TRUE(shared->Compute({}, 0, absl::MakeSpan(none)).ok());
}

EpDispatcherOptions SharedOptions(int ep_size, int64_t capacity, int64_t hidden, int top_k,
                                  int num_experts) {
  EpDispatcherOptions o;
  o.workspace.ep_size = ep_size;
  o.workspace.capacity_tokens = capacity;
  o.workspace.hidden = hidden;
  o.workspace.top_k = top_k;
  o.workspace.dtype = DispatchDType::kBF16;
  o.num_experts = num_experts;
  return o;
}

// Two ranks, identity routed experts (2 per rank), identity shared expert
// gated by gate [0.5, -0.5] (logit 0 for x = [a, a]: g = 0.5). Rank 0 has two
// tokens, rank 1 none (a zero-token rank). Token 0: x = [2, 2], ids [0, 3]
// weights [0.25, 0.5] -> routed (0.75) x = [1.5, 1.5] + shared 0.5 x = [1, 1]
// -> [2.5, 2.5]. Token 1: x = [4, 4], ids [-1, -1] (no expert) -> only the
// shared term 0.5 x = [2, 2].
TEST(EpDispatcherShared, AddsSharedTermAtCombineWithZeroTokenRank) {
  const EpDispatcherOptions options = SharedOptions(2, 4, 2, 2, 4);
  auto store = NewHashStore();
  std::vector<std::vector<bf16_t>> outputs(2);
  RunOnRanks(2, [&](int rank) {
    auto group = JoinLoopback(store, rank, 2);
    ASSERT_TRUE(group.ok()) << group.status();
    auto dispatcher = EpDispatcher::Create(group->get(), options, 0);
    ASSERT_TRUE(dispatcher.ok()) << dispatcher.status();
    const ExpertSet experts = ExpertSet::Identity(2 * rank, 2, 2);
    auto shared = SharedExpert::IdentityWithGate(Bf16({0.5f, -0.5f}), 2);
    ASSERT_TRUE(shared.ok());
    const int64_t tokens = rank == 0 ? 2 : 0;
    const std::vector<bf16_t> hidden = rank == 0 ? Bf16({2, 2, 4, 4}) : std::vector<bf16_t>();
    const std::vector<int32_t> ids =
        rank == 0 ? std::vector<int32_t>{0, 3, -1, -1} : std::vector<int32_t>();
    const std::vector<float> weights =
        rank == 0 ? std::vector<float>{0.25f, 0.5f, 0.0f, 0.0f} : std::vector<float>();
    std::vector<bf16_t> shared_out(hidden.size());
    ASSERT_TRUE(shared->Compute(hidden, tokens, absl::MakeSpan(shared_out)).ok());
    ASSERT_TRUE((*dispatcher)->CommitGeometry(1, 2, tokens).ok());
    outputs[rank].resize(hidden.size());
    absl::Status s = (*dispatcher)
                         ->Forward(hidden, ids, weights, tokens, experts,
                                   absl::MakeSpan(outputs[rank]), shared_out);
    ASSERT_TRUE(s.ok()) << s;
  });
  ASSERT_EQ(outputs[0].size(), 4u);
  EXPECT_EQ(Bf16ToFloat(outputs[0][0]), 2.5f);
  EXPECT_EQ(Bf16ToFloat(outputs[0][1]), 2.5f);
  EXPECT_EQ(Bf16ToFloat(outputs[0][2]), 2.0f);
  EXPECT_EQ(Bf16ToFloat(outputs[0][3]), 2.0f);
  EXPECT_TRUE(outputs[1].empty());
}

// A shared term of the wrong size is this rank's input error, reported to
// both ranks through the agreement round (the peer aborts, nobody hangs).
TEST(EpDispatcherShared, WrongSizedSharedTermIsRejectedCollectively) {
  const EpDispatcherOptions options = SharedOptions(2, 4, 2, 1, 2);
  auto store = NewHashStore();
  std::vector<absl::Status> results(2);
  RunOnRanks(2, [&](int rank) {
    auto group = JoinLoopback(store, rank, 2);
    ASSERT_TRUE(group.ok());
    auto dispatcher = EpDispatcher::Create(group->get(), options, 0);
    ASSERT_TRUE(dispatcher.ok());
    const ExpertSet experts = ExpertSet::Identity(rank, 1, 2);
    const std::vector<bf16_t> hidden = Bf16({1, 1});
    const std::vector<int32_t> ids = {0};
    const std::vector<float> weights = {1.0f};
    std::vector<bf16_t> out(2);
    std::vector<bf16_t> shared_out(rank == 0 ? 3 : 2);
    ASSERT_TRUE((*dispatcher)->CommitGeometry(1, 1, 1).ok());
    results[rank] =
        (*dispatcher)->Forward(hidden, ids, weights, 1, experts, absl::MakeSpan(out), shared_out);
  });
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInvalidArgument) << results[0];
  EXPECT_THAT(results[0].message(), HasSubstr("shared expert output"));
  EXPECT_FALSE(results[1].ok());
}

}  // namespace
}  // namespace moe_ep::core
