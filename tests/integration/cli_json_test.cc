// `--json` of the moe-ep binary's worker commands (issue 9 item 6): `run`,
// `run --tp` and `bench` print progress on stderr and one JSON document on
// stdout, whose values are checked against what is computed here
// independently (the seeded token counts of client/run_job.h and
// client/stack_job.h). Local workers on loopback.

#include <unistd.h>

#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "client/run_job.h"
#include "client/stack_job.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cli_runner.h"

namespace moe_ep::testing {
namespace {

class CliJson : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(MoeEpBinary().c_str(), X_OK) != 0) GTEST_SKIP() << MoeEpBinary() << " not built";
  }
};

TEST_F(CliJson, RunSummaryHasTheLayersAndTheSeededTokenCounts) {
  const CliResult r = RunMoeEp(
      "run --model tiny-moe --workers 2 --backend gloo --layers 2 --tokens 8 --steps 2 --seed 5 "
      "--routing uniform --json",
      /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);  // stdout is only the JSON
  EXPECT_EQ(j["model"], "tiny-moe");
  EXPECT_EQ(j["world"], 2);
  EXPECT_EQ(j["steps"], 2);
  EXPECT_EQ(j["pass"], true);
  // tiny-moe's MoE layers are 1, 2, 3; the first two run.
  ASSERT_EQ(j["layers"].size(), 2u);
  EXPECT_EQ(j["layers"][0]["layer"], 1);
  EXPECT_EQ(j["layers"][1]["layer"], 2);
  int64_t per_layer = 0;
  for (int s = 0; s < 2; ++s) {
    for (int64_t c : client::PlanTokenCounts(8, 2, s, 5)) per_layer += c;
  }
  int64_t total = 0, bytes = 0;
  for (const auto& l : j["layers"]) {
    EXPECT_EQ(l["tokens"], per_layer);
    EXPECT_EQ(l["pass"], true);
    EXPECT_LE(l["max_abs_err"].get<double>(), l["bound"].get<double>());
    total += l["tokens"].get<int64_t>();
    bytes += l["bytes_sent"].get<int64_t>();
  }
  EXPECT_EQ(j["total"]["tokens"], total);
  EXPECT_EQ(j["total"]["bytes_sent"], bytes);
  // tiny-moe: 8 experts over 2 ranks, 4 each of 3 * 256 * 128 * 2 bytes, for 2 layers.
  ASSERT_EQ(j["memory"]["expert_bytes_per_rank"].size(), 2u);
  EXPECT_EQ(j["memory"]["expert_bytes_per_rank"][0], int64_t{2} * 4 * 3 * 256 * 128 * 2);
}

// DESIGN §15 end to end: skewed routing, one redundant slot a worker,
// rebalanced after step 1 from the workers' load statistics; the run still
// matches the dense reference and the load table is printed.
TEST_F(CliJson, RunRebalancesFromTheLoadStatistics) {
  const CliResult r = RunMoeEp(
      "run --model tiny-moe --workers 2 --backend gloo --layers 1 --tokens 64 --steps 3 --seed 3 "
      "--routing skewed --redundant-slots 1 --rebalance-after 1 --json",
      /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["pass"], true);
  ASSERT_EQ(j["rebalance"].size(), 1u);
  const nlohmann::json& l = j["rebalance"][0];
  EXPECT_EQ(l["layer"], 1);
  // tiny-moe: 8 experts on 2 workers, 4 + 1 slots a worker.
  EXPECT_EQ(l["slots_per_rank"], 5);
  const double before = l["before_max_over_mean"].get<double>();
  const double predicted = l["predicted_max_over_mean"].get<double>();
  const double after = l["after_max_over_mean"].get<double>();
  std::cout << "max/mean tokens per rank: before " << before << ", predicted " << predicted
            << ", after " << after << "\n";
  EXPECT_GE(before, 1.0);
  EXPECT_LE(predicted, before);
  EXPECT_GE(after, 1.0);
  // The text form prints the load table.
  const CliResult text = RunMoeEp(
      "run --model tiny-moe --workers 2 --backend gloo --layers 1 --tokens 64 --steps 3 --seed 3 "
      "--routing skewed --redundant-slots 1 --rebalance-after 1");
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_THAT(text.output, ::testing::HasSubstr("load per rank, max/mean tokens"));
  EXPECT_THAT(text.output, ::testing::HasSubstr("rebalance: layer 1, EPLB table"));
}

// DESIGN §15 / issue 17 item 4 from the CLI: 4 local Gloo workers, one
// redundant slot a worker holding the next rank's first expert; rank 2 is
// killed before step 2, the survivors mask it (expert 5, whose only replica
// was there, is lost and contributes zero: the reference drops it too),
// the worker is restarted and re-admitted before step 4. Every step of every
// rank matches the reference.
TEST_F(CliJson, RunKillsARankMasksItAndRejoinsIt) {
  const CliResult r = RunMoeEp(
      "run --model tiny-moe --workers 4 --backend gloo --layers 1 --tokens 32 --steps 5 --seed 3 "
      "--routing uniform --redundant-slots 1 --kill-rank 2 --kill-at-step 2 --restart-at-step 4 "
      "--json",
      /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["pass"], true);
  const nlohmann::json& m = j["masks"];
  EXPECT_EQ(m["kill_rank"], 2);
  EXPECT_EQ(m["kill_at_step"], 2);
  EXPECT_EQ(m["restart_at_step"], 4);
  EXPECT_EQ(m["lost_experts"], std::vector<int>{5});
  // 2 steps x 3 survivors x 32-ish tokens x top-k over 8 experts: some chose 5.
  EXPECT_EQ(m["reported_lost_experts"], std::vector<int>{5});
  EXPECT_GE(m["attempts"].get<int>(), 2);
  std::cout << "kill -> first masked step " << m["kill_to_first_step_ms"] << " ms ("
            << m["attempts"] << " attempts); rejoin " << m["rejoin_ms"]
            << " ms; restart -> first full step " << m["restart_to_first_step_ms"] << " ms\n";
  // Rank 2's tokens are gone while it is masked (steps 2 and 3), back after.
  const CliResult text = RunMoeEp(
      "run --model tiny-moe --workers 4 --backend gloo --layers 1 --tokens 32 --steps 3 --seed 3 "
      "--kill-rank 1 --kill-at-step 2");
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_THAT(text.output, ::testing::HasSubstr("rank 1: killed (SIGKILL) before step 2; experts "
                                                "with no live replica: [2,3]"));
  EXPECT_THAT(text.output, ::testing::HasSubstr("rank 1: masked by the survivors; step 2"));
}

TEST_F(CliJson, RunTpSummaryHasTheSeededGroupCounts) {
  const CliResult r = RunMoeEp(
      "run --model tiny-moe --tp 2 --attn-dp 2 --layers 2 --tokens 6 --steps 2 --seed 4 --json",
      /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["tp"], 2);
  EXPECT_EQ(j["attn_dp"], 2);
  EXPECT_EQ(j["pass"], true);
  EXPECT_EQ(j["sparse_layers"], (std::vector<bool>{false, true}));
  ASSERT_EQ(j["groups"].size(), 4u);  // 2 steps x 2 DP groups
  for (const auto& g : j["groups"]) {
    const int step = g["step"].get<int>();
    const int group = g["dp_group"].get<int>();
    EXPECT_EQ(g["tokens"], client::PlanStackTokenCounts(6, 2, step, 4)[group]);
    EXPECT_LE(g["max_rel_err"].get<double>(), g["tolerance"].get<double>());
  }
}

TEST_F(CliJson, BenchHasOneObjectPerRank) {
  const CliResult r = RunMoeEp(
      "bench --workers 2 --backend gloo --tokens 4 --hidden 32 --top-k 2 --num-experts 4 "
      "--iterations 3 --warmup 1 --json",
      /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["world"], 2);
  EXPECT_EQ(j["tokens_per_rank"], 4);
  EXPECT_EQ(j["hidden"], 32);
  EXPECT_EQ(j["iterations"], 3);
  ASSERT_EQ(j["ranks"].size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const auto& rank = j["ranks"][r];
    EXPECT_EQ(rank["rank"], r);
    EXPECT_LE(rank["dispatch_p50_us"].get<double>(), rank["dispatch_p99_us"].get<double>());
    EXPECT_LE(rank["combine_p50_us"].get<double>(), rank["combine_p99_us"].get<double>());
    EXPECT_GT(rank["dispatch_bytes"].get<int64_t>(), 0);
  }
}

}  // namespace
}  // namespace moe_ep::testing
