#include "client/stack_job.h"

#include <unistd.h>

#include <set>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

TEST(PlanStackTokenCounts, ZeroGroupOnEvenStepsOthersDifferentAndInRange) {
  for (int attn_dp : {2, 3, 4}) {
    for (int64_t step = 0; step < 6; ++step) {
      const std::vector<int64_t> counts = PlanStackTokenCounts(12, attn_dp, step, 5);
      ASSERT_EQ(counts.size(), static_cast<size_t>(attn_dp));
      std::set<int64_t> nonzero;
      for (int g = 0; g < attn_dp; ++g) {
        const bool zero_group = step % 2 == 0 && g == (step / 2) % attn_dp;
        if (zero_group) {
          EXPECT_EQ(counts[g], 0) << "attn_dp " << attn_dp << " step " << step;
          continue;
        }
        // [T/2, 3T/2] = [6, 18], plus at most attn_dp - 1 bumps.
        EXPECT_GE(counts[g], 6);
        EXPECT_LE(counts[g], 18 + attn_dp - 1);
        nonzero.insert(counts[g]);
      }
      EXPECT_EQ(nonzero.size(), static_cast<size_t>(attn_dp - (step % 2 == 0 ? 1 : 0)))
          << "counts must differ per group";
    }
  }
  EXPECT_EQ(PlanStackTokenCounts(12, 2, 3, 5), PlanStackTokenCounts(12, 2, 3, 5));
}

TEST(PlanStackTokenCounts, SingleGroupNeverEmpty) {
  for (int64_t step = 0; step < 4; ++step) {
    const std::vector<int64_t> counts = PlanStackTokenCounts(8, 1, step, 1);
    ASSERT_EQ(counts.size(), 1u);
    EXPECT_GE(counts[0], 4);
    EXPECT_LE(counts[0], 12);
  }
}

TEST(ValidateStackJobOptions, DefaultsAreValid) { EXPECT_TRUE(ValidateStackJobOptions({}).ok()); }

TEST(ValidateStackJobOptions, RejectsEachBadFlag) {
  struct Case {
    std::function<void(StackJobOptions&)> mutate;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {[](StackJobOptions& o) { o.tp_size = 0; }, "--tp: expected >= 1, got 0"},
      {[](StackJobOptions& o) { o.attn_dp_size = 3; }, "--attn-dp: expected a divisor of --tp (2)"},
      {[](StackJobOptions& o) {
         o.tp_size = 8;
         o.attn_dp_size = 2;
         o.moe_dense_tp_size = 2;
       },
       "--moe-dense-tp: expected 1, 4 (attn_tp) or 8 (tp), got 2"},
      {[](StackJobOptions& o) { o.num_layers = 0; }, "--layers"},
      {[](StackJobOptions& o) { o.hidden = -1; }, "--hidden"},
      {[](StackJobOptions& o) { o.tokens_per_group = 0; }, "--tokens"},
      {[](StackJobOptions& o) { o.steps = 0; }, "--steps"},
  };
  for (const Case& c : cases) {
    StackJobOptions o;
    c.mutate(o);
    absl::Status s = ValidateStackJobOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.fragment;
    EXPECT_THAT(s.message(), HasSubstr(c.fragment));
  }
}

TEST(RunStackJob, RejectsMoreLayersThanTheModelHasBeforeStartingWorkers) {
  StackJobOptions o;
  o.num_layers = 5;                                        // tiny-moe has 4
  o.workers.worker_binary = "/nonexistent/moe-ep-worker";  // never reached
  std::ostringstream out;
  auto r = RunStackJob(o, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("--layers: expected <= 4"));
}

TEST(RunStackJob, RejectsTargetsOfTheWrongCount) {
  StackJobOptions o;
  o.tp_size = 2;
  o.workers.targets = "127.0.0.1:1";
  std::ostringstream out;
  auto r = RunStackJob(o, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("--targets: expected 2 workers (--tp), got 1"));
}

TEST(RunStackJob, DenseIntermediateMustDivideByTp) {
  StackJobOptions o;
  o.tp_size = 4;
  o.dense_intermediate = 30;
  o.workers.worker_binary = "/nonexistent/moe-ep-worker";  // never reached
  std::ostringstream out;
  auto r = RunStackJob(o, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("dense_intermediate"));
}

TEST(RunStackJob, TinyModelTp2AttnDp2EndToEndPasses) {
  const std::string worker = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  if (access(worker.c_str(), X_OK) != 0) GTEST_SKIP() << worker << " is not built";
  StackJobOptions o;  // tiny-moe: layer 0 dense, layers 1-3 sparse
  o.tp_size = 2;
  o.attn_dp_size = 2;
  o.hidden = 32;
  o.moe_intermediate = 32;
  o.dense_intermediate = 64;
  o.steps = 2;
  o.workers.worker_binary = worker;
  o.rpc_timeout = absl::Seconds(60);
  std::ostringstream out;
  auto r = RunStackJob(o, out);
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << out.str();
  EXPECT_TRUE(r->AllPass()) << out.str() << RenderStackSummary(*r);
  ASSERT_EQ(r->groups.size(), 4u);  // 2 steps x 2 DP groups
  EXPECT_EQ(r->groups[0].tokens + r->groups[1].tokens,
            std::max(r->groups[0].tokens, r->groups[1].tokens));  // step 0: one group empty
  EXPECT_GT(r->groups[2].tokens, 0);
  EXPECT_GT(r->groups[3].tokens, 0);
  EXPECT_EQ(r->sparse_layers, (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(r->after_mlp_ops.size(), 4u);
  EXPECT_THAT(out.str(), HasSubstr("stack built in"));
  const std::string summary = RenderStackSummary(*r);
  EXPECT_THAT(summary, HasSubstr("PASS: every DP group matches"));
  EXPECT_THAT(summary, HasSubstr("tp 2, attn_dp 2"));
}

TEST(RenderStackSummary, FailingGroupSaysFail) {
  StackJobResult result;
  result.model_name = "m";
  result.tp_size = 2;
  result.attn_dp_size = 1;
  result.sparse_layers = {true};
  StackGroupResult g;
  g.tokens = 3;
  g.padding_mode = "MAX_LEN";
  g.max_rel_err = 0.5;
  g.tolerance = 1.0 / 128;
  g.pass = false;
  result.groups.push_back(g);
  EXPECT_FALSE(result.AllPass());
  const std::string summary = RenderStackSummary(result);
  EXPECT_THAT(summary, HasSubstr("FAIL: at least one DP group differs"));
  EXPECT_THAT(summary, HasSubstr("NO"));
}

}  // namespace
}  // namespace moe_ep::client
