#include "client/stack_memory_budget.h"

#include <sstream>

#include "absl/strings/str_cat.h"
#include "client/memory_budget.h"
#include "client/stack_job.h"
#include "client/text_table.h"
#include "core/host_memory.h"
#include "core/layer_stack_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace stack_memory_budget_test {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

// DeepSeek-V3's first 4 layers (0-2 dense, 3 sparse) at tp 2, as `moe-ep
// stack --model DeepSeek-V3.json --tp 2 --layers 4` builds them.
StackMemoryInput DeepSeekV3Tp2Layers4() {
  StackMemoryInput in;
  core::LayerStackConfig& c = in.config;
  c.layout = core::ParallelLayout{2, 1, 0};
  c.sparse_layers = {false, false, false, true};
  c.hidden = 7168;
  c.dense_intermediate = 18432;
  c.moe_intermediate = 2048;
  c.num_experts = 256;
  c.top_k = 8;
  c.capacity_tokens = 20;
  in.num_local_workers = 2;
  in.step_rows = 18;
  in.gathered_rows = 18;
  return in;
}

TEST(EstimateStackMemory, DeepSeekV3HandNumbers) {
  const StackMemoryInput in = DeepSeekV3Tp2Layers4();
  auto e = EstimateStackMemory(in);
  ASSERT_TRUE(e.ok()) << e.status();
  // Rank 0: 4 x (attention 7168^2*4 + norms 2*7168*4) + 3 dense MLPs
  // 3*18432*7168*2 + 128 experts x 3*2048*7168*2, plus the workspace.
  const int64_t attention = int64_t{7168} * 7168 * 4 + 2 * 7168 * 4;  // 205,578,240
  const int64_t dense = int64_t{3} * 18432 * 7168 * 2;                // 792,723,456
  const int64_t expert = int64_t{3} * 2048 * 7168 * 2;                // 88,080,384
  const int64_t weights = 4 * attention + 3 * dense + 128 * expert;
  EXPECT_GT(e->worker_stack_bytes, weights);
  EXPECT_LT(e->worker_stack_bytes, weights + 64 * kMiB);  // a 20-token workspace is small
  EXPECT_EQ(e->worker_stack_bytes, *core::EstimateLayerStackBytes(in.config, 0));
  // Other: scratch (dense I 18432 sharded over tp 2 = 9216, wider than the
  // expert's 2048) + 16 * rows * H + 128 MiB.
  const int64_t scratch = int64_t{3} * 9216 * 7168 * 4 + 18 * (8 * 4 * 7168 + 2 * 4 * 9216 + 64);
  EXPECT_EQ(e->worker_other_bytes, scratch + 16 * 18 * 7168 + 128 * kMiB);
  EXPECT_EQ(e->worker_bytes, e->worker_stack_bytes + e->worker_other_bytes);
  EXPECT_EQ(e->local_workers_bytes, 2 * e->worker_bytes);
  // The reference holds layer 3 whole: 256 experts (21 GiB) + attention,
  // with the dense MLP widened to fp32 as its largest scratch.
  const int64_t ref_scratch =
      int64_t{3} * 18432 * 7168 * 4 + 18 * (8 * 4 * 7168 + 2 * 4 * 18432 + 64);
  EXPECT_EQ(e->reference_bytes, attention + 256 * expert + ref_scratch);
  EXPECT_EQ(e->coordinator_bytes, e->reference_bytes + 18 * 7168 * (8 + 4 * 2) + 256 * kMiB);
  EXPECT_EQ(e->needed_bytes, e->local_workers_bytes + e->coordinator_bytes);
  EXPECT_GT(e->needed_bytes, 50 * kGiB);  // ~2 x 15 GiB + 23 GiB
}

TEST(EstimateStackMemory, TargetsRunNoLocalWorkers) {
  StackMemoryInput in = DeepSeekV3Tp2Layers4();
  in.num_local_workers = 0;
  auto e = EstimateStackMemory(in);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->local_workers_bytes, 0);
  EXPECT_EQ(e->needed_bytes, e->coordinator_bytes);
}

TEST(EstimateStackMemory, RejectsNegativeFields) {
  StackMemoryInput in = DeepSeekV3Tp2Layers4();
  in.step_rows = -1;
  EXPECT_THAT(EstimateStackMemory(in).status().message(),
              HasSubstr("step_rows: expected >= 0, got -1"));
  in = DeepSeekV3Tp2Layers4();
  in.num_local_workers = -2;
  EXPECT_THAT(EstimateStackMemory(in).status().message(), HasSubstr("num_local_workers"));
  in = DeepSeekV3Tp2Layers4();
  in.config.hidden = 0;
  EXPECT_EQ(EstimateStackMemory(in).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckStackMemory, DeepSeekV3OnA22GiBMachineIsRefusedWithTheFiguresAndOptions) {
  const StackMemoryInput in = DeepSeekV3Tp2Layers4();
  const int64_t available = 22 * kGiB;
  const absl::Status s = CheckStackMemory(in, available);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const auto e = *EstimateStackMemory(in);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(
                               "needs about ", FormatBytes(static_cast<double>(e.needed_bytes)))));
  // 22 GiB minus a 2.2 GiB margin.
  EXPECT_THAT(s.message(), HasSubstr("only 19.8 GiB is available (MemAvailable 22.0 GiB"));
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("2 local worker(s) x ",
                                     FormatBytes(static_cast<double>(e.worker_bytes)))));
  EXPECT_THAT(s.message(), HasSubstr("holds its largest layer whole"));
  // Layers 0-2 alone (dense: ~3.8 GiB a worker, ~3.5 GiB here) fit.
  EXPECT_THAT(s.message(), HasSubstr("--layers 3 "));
  EXPECT_THAT(s.message(), HasSubstr("--hidden, --moe-intermediate, --dense-intermediate"));
  // The reference alone (21+ GiB) is too much even with --targets.
  EXPECT_THAT(s.message(), HasSubstr("this process alone needs"));
  EXPECT_THAT(s.message(), HasSubstr("still too much"));
}

TEST(CheckStackMemory, FitsWhenAvailableCoversItAndTheMargin) {
  const StackMemoryInput in = DeepSeekV3Tp2Layers4();
  const auto e = *EstimateStackMemory(in);
  // usable = available - max(1 GiB, available / 10) >= needed.
  const int64_t enough = e.needed_bytes + e.needed_bytes / 9 + kGiB;
  EXPECT_TRUE(CheckStackMemory(in, enough).ok());
  EXPECT_EQ(CheckStackMemory(in, e.needed_bytes).code(), absl::StatusCode::kResourceExhausted);
  const int64_t cap = StackWorkerMemoryCapBytes(e, 2, enough);
  EXPECT_GE(cap, e.worker_bytes);
  EXPECT_EQ(cap, (enough - MemorySafetyMarginBytes(enough) - e.coordinator_bytes) / 2);
  EXPECT_EQ(StackWorkerMemoryCapBytes(e, 0, enough), 0);
}

TEST(RunStackJob, DeepSeekV3Tp2Layers4IsRefusedBeforeAnyWorkerStarts) {
  StackJobOptions o;
  o.model = "deepseek-v3";
  o.tp_size = 2;
  o.num_layers = 4;
  o.workers.worker_binary = "/nonexistent/moe-ep-worker";  // never reached
  const absl::StatusOr<int64_t> available = core::AvailableMemoryBytes();
  if (!available.ok()) GTEST_SKIP() << "no MemAvailable here: " << available.status();
  if (*available > 60 * kGiB) GTEST_SKIP() << "this machine has room for the stack";
  std::ostringstream out;
  auto r = RunStackJob(o, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("memory preflight: this stack needs about"));
  EXPECT_THAT(out.str(), ::testing::Not(HasSubstr("workers: starting")));
}

}  // namespace
}  // namespace stack_memory_budget_test
}  // namespace moe_ep::client
