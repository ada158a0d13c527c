#include "client/run_job.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>

#include "absl/strings/str_join.h"
#include "client/coordinator.h"
#include "client/memory_budget.h"
#include "client/worker_selection.h"
#include "core/host_memory.h"
#include "core/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace run_job_test {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string DataDir() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  return env != nullptr && *env != '\0' ? env : MOE_EP_DATA_DIR;
}

TEST(PlanTokenCounts, OneZeroRankOthersWithinHalfOfTheMean) {
  for (int64_t step = 0; step < 8; ++step) {
    const auto counts = PlanTokenCounts(256, 4, step, 7);
    ASSERT_EQ(counts.size(), 4u);
    // The zero rank rotates: step 0 -> rank 3, step 1 -> rank 0, ...
    const int zero_rank = static_cast<int>((3 + step) % 4);
    for (int r = 0; r < 4; ++r) {
      if (r == zero_rank) {
        EXPECT_EQ(counts[r], 0) << "step " << step;
      } else {
        EXPECT_GE(counts[r], 128);
        EXPECT_LE(counts[r], 384);
      }
    }
    EXPECT_EQ(counts, PlanTokenCounts(256, 4, step, 7));  // deterministic
  }
  EXPECT_NE(PlanTokenCounts(256, 4, 0, 7), PlanTokenCounts(256, 4, 0, 8));
}

TEST(PlanTokenCounts, SingleRankGetsTheMean) {
  EXPECT_EQ(PlanTokenCounts(100, 1, 3, 1), std::vector<int64_t>{100});
}

TEST(GenerateHidden, DeterministicPerStepAndRank) {
  const auto a = GenerateHidden(1, 0, 2, 3, 16);
  ASSERT_EQ(a.size(), 48u);
  EXPECT_EQ(a, GenerateHidden(1, 0, 2, 3, 16));
  EXPECT_NE(a, GenerateHidden(1, 0, 1, 3, 16));
  EXPECT_NE(a, GenerateHidden(1, 1, 2, 3, 16));
  EXPECT_TRUE(GenerateHidden(1, 0, 0, 0, 16).empty());
  // N(0, 1): over 4096 values the mean is near 0 and the variance near 1.
  const auto big = GenerateHidden(5, 0, 0, 64, 64);
  double sum = 0, sq = 0;
  for (auto v : big) {
    const double f = core::Bf16ToFloat(v);
    sum += f;
    sq += f * f;
  }
  EXPECT_NEAR(sum / big.size(), 0.0, 0.1);
  EXPECT_NEAR(sq / big.size(), 1.0, 0.1);
}

TEST(ExpertBytesPerLayer, Qwen3Preset) {
  core::ModelDescription m;
  m.num_experts = 128;
  m.moe_intermediate_size = 768;
  m.hidden_size = 2048;
  // 128 experts x 3 matrices x 768 x 2048 x 2 bytes = 1,207,959,552 (1.125 GiB).
  EXPECT_EQ(ExpertBytesPerLayer(m), 1207959552);
}

TEST(ValidateRunJobOptions, DefaultsAreValid) { EXPECT_TRUE(ValidateRunJobOptions({}).ok()); }

TEST(ValidateRunJobOptions, RebalanceNeedsRedundantSlotsAndALaterStep) {
  RunJobOptions o;
  o.steps = 3;
  o.rebalance_after_steps = 1;
  EXPECT_THAT(std::string(ValidateRunJobOptions(o).message()),
              ::testing::HasSubstr("--rebalance-after: needs --redundant-slots >= 1"));
  o.redundant_slots_per_rank = 2;
  EXPECT_TRUE(ValidateRunJobOptions(o).ok());
  o.rebalance_after_steps = 3;
  EXPECT_THAT(std::string(ValidateRunJobOptions(o).message()),
              ::testing::HasSubstr("--rebalance-after: expected in [0, --steps - 1 = 2]"));
  o.rebalance_after_steps = 0;
  o.redundant_slots_per_rank = -1;
  EXPECT_EQ(ValidateRunJobOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

// --kill-rank / --kill-at-step / --restart-at-step (issue 17 item 4).
TEST(ValidateRunJobOptions, KillOptionsComeTogetherInOrderOnLocalWorkers) {
  RunJobOptions o;
  o.steps = 4;
  o.kill_rank = 1;
  EXPECT_THAT(std::string(ValidateRunJobOptions(o).message()),
              HasSubstr("--kill-rank and --kill-at-step: give both"));
  o.kill_at_step = 2;
  EXPECT_TRUE(ValidateRunJobOptions(o).ok());
  o.restart_at_step = 4;
  EXPECT_TRUE(ValidateRunJobOptions(o).ok());
  o.restart_at_step = 2;
  EXPECT_THAT(
      std::string(ValidateRunJobOptions(o).message()),
      HasSubstr("--restart-at-step: expected in (--kill-at-step, --steps] = (2, 4], got 2"));
  o.restart_at_step = 0;
  o.kill_at_step = 5;
  EXPECT_THAT(std::string(ValidateRunJobOptions(o).message()),
              HasSubstr("--kill-at-step: expected in [1, --steps = 4], got 5"));
  o.kill_at_step = 2;
  o.workers.targets = "127.0.0.1:1,127.0.0.1:2";
  EXPECT_THAT(std::string(ValidateRunJobOptions(o).message()),
              HasSubstr("--kill-rank: kills one of the local workers"));
  o.workers.targets.clear();
  o.kill_rank = -1;
  o.kill_at_step = 0;
  o.restart_at_step = 3;
  EXPECT_EQ(ValidateRunJobOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateRunJobOptions, RejectsEachBadFlag) {
  struct Case {
    std::function<void(RunJobOptions&)> edit;
    const char* fragment;
  };
  const std::vector<Case> cases = {
      {[](RunJobOptions& o) { o.num_layers = 0; }, "--layers"},
      {[](RunJobOptions& o) { o.tokens_per_rank = 0; }, "--tokens"},
      {[](RunJobOptions& o) { o.steps = 0; }, "--steps"},
      {[](RunJobOptions& o) { o.capacity_tokens = -1; }, "--capacity"},
      {[](RunJobOptions& o) { o.experts = "relu"; }, "--experts"},
      {[](RunJobOptions& o) { o.tolerance.rel = -1; }, "tolerance"},
      {[](RunJobOptions& o) { o.attach = true; }, "--attach: needs --targets"},
      {[](RunJobOptions& o) {
         o.attach = true;
         o.workers.targets = "127.0.0.1:1";
         o.redundant_slots_per_rank = 1;
       },
       "--attach: drives steps only"},
  };
  for (const Case& c : cases) {
    RunJobOptions o;
    c.edit(o);
    const absl::Status s = ValidateRunJobOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.fragment;
    EXPECT_THAT(s.message(), HasSubstr(c.fragment));
  }
}

TEST(RunJob, RejectsMoreLayersThanTheModelHasBeforeStartingWorkers) {
  RunJobOptions o;
  o.model = "tiny-moe";  // 4 layers, 3 sparse
  o.num_layers = 4;
  o.workers.worker_binary = "/nonexistent/moe-ep-worker";  // never reached
  std::ostringstream out;
  auto r = RunJob(o, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("has 3 MoE layers, asked for 4"));
}

TEST(RunJob, UnknownModelIsNotFound) {
  RunJobOptions o;
  o.model = "no-such-preset";
  std::ostringstream out;
  EXPECT_EQ(RunJob(o, out).status().code(), absl::StatusCode::kNotFound);
}

TEST(RunJob, RejectsZeroWorkersBeforeStartingAny) {
  RunJobOptions o;
  o.model = "tiny-moe";
  o.workers.num_workers = 0;
  std::ostringstream out;
  auto r = RunJob(o, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("--workers: expected >= 1, got 0"));
}

TEST(RunJob, DeepSeekV3TooLargeFailsFastWithTheOptions) {
  const std::string path = DataDir() + "/models/DeepSeek-V3.json";
  if (access(path.c_str(), R_OK) != 0) GTEST_SKIP() << path << " is missing";
  // The same preflight by hand: skip on a machine where one layer fits.
  RunMemoryInput in;
  in.num_experts = 256;
  in.hidden = 7168;
  in.intermediate = 2048;
  in.top_k = 8;
  in.world = 4;
  in.num_local_workers = 4;
  in.num_layers = 1;
  in.capacity_tokens = 384;
  in.rows_per_layer = 2 * 3 * 384;
  in.max_step_rows = 3 * 384;
  auto available = core::AvailableMemoryBytes();
  ASSERT_TRUE(available.ok()) << available.status();
  if (CheckRunMemory(in, *available).ok()) {
    GTEST_SKIP() << "this machine has room for a DeepSeek-V3 layer";
  }
  RunJobOptions o;
  o.model = path;
  o.num_layers = 1;
  o.workers.worker_binary = "/nonexistent/moe-ep-worker";  // never reached
  std::ostringstream out;
  auto r = RunJob(o, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string message(r.status().message());
  EXPECT_THAT(message, HasSubstr("memory preflight: this run needs about"));
  EXPECT_THAT(message, HasSubstr("one layer's experts are 21.0 GiB"));
  EXPECT_THAT(message, HasSubstr("--experts identity"));
  EXPECT_THAT(message, HasSubstr("--layers"));
  EXPECT_THAT(message, HasSubstr("--targets"));
}

TEST(RunJob, DeepSeekV3IdentityPassesThePreflight) {
  const std::string path = DataDir() + "/models/DeepSeek-V3.json";
  if (access(path.c_str(), R_OK) != 0) GTEST_SKIP() << path << " is missing";
  RunJobOptions o;
  o.model = path;
  o.experts = "identity";
  o.workers.worker_binary = "/nonexistent/moe-ep-worker";
  std::ostringstream out;
  auto r = RunJob(o, out);
  // Past the preflight: the next step, starting workers, fails on the binary.
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("/nonexistent/moe-ep-worker"));
  EXPECT_THAT(out.str(), HasSubstr("memory: needs about"));
}

TEST(RunJob, TinyModelEndToEndVerifiesInChunks) {
  const std::string worker = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  if (access(worker.c_str(), X_OK) != 0) GTEST_SKIP() << worker << " is not built";
  RunJobOptions o;
  o.model = "tiny-moe";  // 8 experts, H 128, I 256 (per expert 192 KiB)
  o.num_layers = 2;
  o.tokens_per_rank = 24;
  o.workers.num_workers = 2;
  o.workers.worker_binary = worker;
  o.rpc_timeout = absl::Seconds(60);
  std::ostringstream out;
  auto r = RunJob(o, out);
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << out.str();
  EXPECT_TRUE(r->AllPass()) << out.str();
  // 8 experts fit one chunk (at most 16): one chunk per layer.
  EXPECT_EQ(r->memory.reference_chunk_experts, 8);
  EXPECT_EQ(r->reference_chunks_made + r->reference_chunks_skipped, 2);
  EXPECT_GT(r->memory_available_bytes, 0);
  EXPECT_THAT(out.str(), HasSubstr("capped at"));
  EXPECT_THAT(RenderRunSummary(*r), HasSubstr("the reference's chunk (8 experts"));
}

// --attach (issue 12 item 6): a second client drives verified steps on a
// group another client formed, configured and loaded, without Join (the
// generation stays) or any leased call; the check is real: a run whose seed
// differs from the loaded experts' fails it.
TEST(RunJob, AttachDrivesVerifiedStepsOnAFormedGroup) {
  const std::string worker = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  if (access(worker.c_str(), X_OK) != 0) GTEST_SKIP() << worker << " is not built";
  WorkerSelection local;
  local.num_workers = 2;
  local.backend = "gloo";
  local.worker_binary = worker;
  absl::StatusOr<AttachedWorkers> cluster = AttachWorkers(local);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  RunJobOptions o;
  o.model = "tiny-moe";
  o.num_layers = 2;
  o.tokens_per_rank = 24;
  o.steps = 1;
  o.capacity_tokens = 64;
  o.workers.targets = absl::StrJoin(cluster->targets, ",");
  o.workers.lease.owner_id = "owner@test";
  o.rpc_timeout = absl::Seconds(60);
  std::ostringstream formed_out;
  auto formed = RunJob(o, formed_out);  // forms, configures, allocates, loads
  ASSERT_TRUE(formed.ok()) << formed.status() << "\n" << formed_out.str();
  ASSERT_TRUE(formed->AllPass()) << formed_out.str();
  auto before = Coordinator::Connect(cluster->targets);
  ASSERT_TRUE(before.ok());
  auto status_before = (*before)->Status();
  ASSERT_TRUE(status_before.ok()) << status_before.status();

  o.attach = true;
  o.steps = 2;
  o.workers.lease.owner_id.clear();
  std::ostringstream out;
  auto attached = RunJob(o, out);
  ASSERT_TRUE(attached.ok()) << attached.status() << "\n" << out.str();
  EXPECT_TRUE(attached->AllPass()) << out.str();
  EXPECT_THAT(out.str(), HasSubstr("group: attached to the 2 workers' group of generation "));
  EXPECT_THAT(out.str(), Not(HasSubstr("experts: layer")));  // nothing loaded here
  ASSERT_EQ(attached->layers.size(), 2u);
  EXPECT_GT(attached->layers[0].comparison.num_elements, 0);
  auto status_after = (*before)->Status();
  ASSERT_TRUE(status_after.ok());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ((*status_after)[r].generation(), (*status_before)[r].generation());
    EXPECT_EQ((*status_after)[r].counters().forwards(),
              (*status_before)[r].counters().forwards() + 2 * 2);  // 2 steps x 2 layers
  }

  o.seed = 2;  // not the loaded experts' seed: every layer disagrees
  std::ostringstream wrong_out;
  auto wrong = RunJob(o, wrong_out);
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  EXPECT_FALSE(wrong->AllPass()) << wrong_out.str();

  // A workspace below the run's largest count is refused before any step.
  o.seed = 1;
  o.tokens_per_rank = 200;
  std::ostringstream small_out;
  auto small = RunJob(o, small_out);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(small.status().message(), HasSubstr("has a workspace of 64 tokens per rank"));
}

TEST(RenderRunSummary, TableTotalsAndFootprint) {
  RunJobResult r;
  r.world = 4;
  r.steps = 2;
  r.num_sparse_layers = 48;
  r.layer_expert_bytes = 1207959552;
  r.expert_bytes_per_rank = {905969664, 905969664, 905969664, 905969664};
  LayerRunSummary a;
  a.layer = 0;
  a.tokens = 1000;
  a.max_r = 300;
  a.bytes_sent = 1 << 20;
  a.forward_s = 2.0;
  a.comparison.max_abs_err = 0.001;
  a.comparison.bound = 0.004;
  LayerRunSummary b = a;
  b.layer = 1;
  b.comparison.pass = false;
  b.comparison.max_abs_err = 0.5;
  r.layers = {a, b};
  EXPECT_FALSE(r.AllPass());
  const std::string text = RenderRunSummary(r);
  EXPECT_THAT(text, HasSubstr("total    2000  300    2.00 MiB  4.000 s          0.5         FAIL"));
  EXPECT_THAT(text, HasSubstr("FAIL"));
  EXPECT_THAT(text, HasSubstr("throughput: 500 tokens/s through 2 MoE layer(s) on 4 ranks"));
  EXPECT_THAT(text, HasSubstr("864 MiB"));   // per worker, held
  EXPECT_THAT(text, HasSubstr("13.5 GiB"));  // 48 layers / 4 ranks
  EXPECT_THAT(text, HasSubstr("54.0 GiB"));  // 48 layers
}

}  // namespace
}  // namespace run_job_test
}  // namespace moe_ep::client
