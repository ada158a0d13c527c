#include "core/step_executor.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

// core::HostStepExecutor on hand-made programs with hand-computed values.
// The layer programs themselves run in tests/core/layer_step_programs_test.cc
// (DESIGN §4's worked examples) and through the layer stack.

namespace moe_ep::core {
namespace step_executor_test {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kH = 2;

StepPrimitive Prim(StepOp op, StepTensor t, int64_t in, int64_t out,
                   StepGroup g = StepGroup::kAttnTp) {
  StepPrimitive p;
  p.op = op;
  p.tensor = t;
  p.source = t;
  p.group = g;
  p.rows_in = in;
  p.rows_out = out;
  return p;
}

StepProgram Program(int64_t h_in, int64_t r_in, std::vector<StepPrimitive> prims, int64_t h_out,
                    int64_t r_out) {
  StepProgram p;
  p.label = "test";
  p.hidden_rows_in = h_in;
  p.residual_rows_in = r_in;
  p.primitives = std::move(prims);
  p.hidden_rows_out = h_out;
  p.residual_rows_out = r_out;
  EXPECT_TRUE(ValidateStepProgram(p, ParallelLayout{2, 1, 0}).ok() ||
              ValidateStepProgram(p, ParallelLayout{1, 1, 0}).ok());
  return p;
}

// Runs fn on `n` Gloo ranks with ParallelGroups of tp n, attn_dp 1.
void OnRanks(int n, const std::function<void(int, const ParallelGroups&)>& fn) {
  auto store = NewHashStore();
  RunOnRanks(n, [&](int rank) {
    auto world = JoinLoopback(store, rank, n);
    ASSERT_TRUE(world.ok()) << world.status();
    auto groups = ParallelGroups::Create(world->get(), ParallelLayout{n, 1, 0});
    ASSERT_TRUE(groups.ok()) << groups.status();
    fn(rank, **groups);
  });
}

TEST(HostStepExecutor, AddPlaceSliceAndNormOnOneRank) {
  OnRanks(1, [](int, const ParallelGroups& groups) {
    HostStepExecutor exec(&groups, kH);
    // hidden [[1, 2]], residual [[3, 4]]:
    //   add_residual        hidden [[4, 6]]
    //   place 1 -> 3 at 1   hidden [[0, 0], [4, 6], [0, 0]]
    //   slice residual := hidden[1, 2)   residual [[4, 6]]
    //   slice hidden := hidden[1, 3)     hidden [[4, 6], [0, 0]]
    //   norm (weight [2, 2], eps 1e-6: rms of [4, 6] is sqrt(26 + eps))
    StepPrimitive place = Prim(StepOp::kPlace, StepTensor::kHidden, 1, 3);
    place.first = 1;
    StepPrimitive to_residual = Prim(StepOp::kSlice, StepTensor::kResidual, 3, 1);
    to_residual.source = StepTensor::kHidden;
    to_residual.first = 1;
    StepPrimitive slice = Prim(StepOp::kSlice, StepTensor::kHidden, 3, 2);
    slice.first = 1;
    const StepProgram program =
        Program(1, 1,
                {Prim(StepOp::kAddResidual, StepTensor::kHidden, 1, 1), place, to_residual, slice,
                 Prim(StepOp::kNorm, StepTensor::kHidden, 2, 2)},
                2, 1);
    auto norm = RmsNorm::Create({2.0f, 2.0f}, 1e-6f);
    ASSERT_TRUE(norm.ok()) << norm.status();
    LayerActivations act{{1, 2}, std::vector<float>{3, 4}};
    ASSERT_TRUE(exec.Run(program, &*norm, act).ok());
    const double rms = std::sqrt((16.0 + 36.0) / 2.0 + 1e-6);
    ASSERT_EQ(act.hidden.size(), 4u);
    EXPECT_NEAR(act.hidden[0], 2 * 4 / rms, 1e-6);
    EXPECT_NEAR(act.hidden[1], 2 * 6 / rms, 1e-6);
    EXPECT_EQ(act.hidden[2], 0.0f);  // a zero row stays zero
    EXPECT_EQ(act.hidden[3], 0.0f);
    ASSERT_TRUE(act.residual.has_value());
    EXPECT_THAT(*act.residual, ElementsAre(4.0f, 6.0f));
    EXPECT_EQ(exec.name(), "host");
  });
}

TEST(HostStepExecutor, ReduceScatterThenAllGatherOnTwoRanks) {
  OnRanks(2, [](int rank, const ParallelGroups& groups) {
    HostStepExecutor exec(&groups, kH);
    // Rank r holds [[r+1, 10(r+1)], [100(r+1), 1000(r+1)]]; the sum over both
    // ranks is [[3, 30], [300, 3000]]: rank 0 keeps row 0, rank 1 row 1, and
    // the all-gather gives both rows back to both.
    const StepProgram program =
        Program(2, -1,
                {Prim(StepOp::kReduceScatter, StepTensor::kHidden, 2, 1, StepGroup::kWorld),
                 Prim(StepOp::kAllGather, StepTensor::kHidden, 1, 2)},
                2, -1);
    const float s = static_cast<float>(rank + 1);
    LayerActivations act{{s, 10 * s, 100 * s, 1000 * s}, std::nullopt};
    auto program_rs = program;
    program_rs.primitives.pop_back();
    program_rs.hidden_rows_out = 1;
    LayerActivations half = act;
    ASSERT_TRUE(exec.Run(program_rs, nullptr, half).ok());
    if (rank == 0) {
      EXPECT_THAT(half.hidden, ElementsAre(3.0f, 30.0f));
    } else {
      EXPECT_THAT(half.hidden, ElementsAre(300.0f, 3000.0f));
    }
    ASSERT_TRUE(exec.Run(program, nullptr, act).ok());
    EXPECT_THAT(act.hidden, ElementsAre(3.0f, 30.0f, 300.0f, 3000.0f));
    EXPECT_FALSE(act.residual.has_value());
  });
}

TEST(HostStepExecutor, RejectsInputsThatDoNotMatchTheProgram) {
  OnRanks(1, [](int, const ParallelGroups& groups) {
    HostStepExecutor exec(&groups, kH);
    const StepProgram norm_program =
        Program(2, 2, {Prim(StepOp::kAddAndNorm, StepTensor::kHidden, 2, 2)}, 2, 2);
    auto norm = RmsNorm::Create({1.0f, 1.0f}, 1e-6f);
    ASSERT_TRUE(norm.ok());
    LayerActivations three{std::vector<float>(3 * kH), std::vector<float>(2 * kH)};
    absl::Status s = exec.Run(norm_program, &*norm, three);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("hidden must have 2 rows * H 2, got 3 rows"));
    LayerActivations no_residual{std::vector<float>(2 * kH), std::nullopt};
    s = exec.Run(norm_program, &*norm, no_residual);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("residual must have 2 rows * H 2, got none"));
    LayerActivations ok{std::vector<float>(2 * kH), std::vector<float>(2 * kH)};
    s = exec.Run(norm_program, nullptr, ok);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("needs an RMSNorm of width H 2, got none"));
    auto wide = RmsNorm::Create({1.0f, 1.0f, 1.0f}, 1e-6f);
    ASSERT_TRUE(wide.ok());
    s = exec.Run(norm_program, &*wide, ok);
    EXPECT_THAT(std::string(s.message()), HasSubstr("got width 3"));
    const StepProgram empty = Program(2, -1, {}, 2, -1);
    s = exec.Run(empty, nullptr, ok);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("takes no residual"));
    LayerActivations ragged{std::vector<float>(3), std::nullopt};
    s = exec.Run(empty, nullptr, ragged);
    EXPECT_THAT(std::string(s.message()), HasSubstr("not rows of H 2"));
    // Nothing changed on the rejected calls.
    EXPECT_EQ(ok.hidden, std::vector<float>(2 * kH));
  });
}

}  // namespace
}  // namespace step_executor_test
}  // namespace moe_ep::core
