// kernels::MaskedStreamCollective (DESIGN §15 rank masks; issue 17 item 3):
// a world-2 group with one rank lost, served by the survivor's world-1
// NCCL communicator (what ncclCommShrink leaves it), so every case runs on
// one GPU: the collective's echo and zero rows, and the GPU dispatcher's
// masked steps against the CPU reference under the same mask (lost experts
// contribute zero). Without a GPU every test skips with the reason printed.

#include "kernels/masked_stream_collective.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/expert_source.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
#include "core/routing.h"
#include "core/shrink_plan.h"
#include "kernels/device_experts.h"
#include "kernels/gpu_ep_dispatcher.h"
#include "kernels/nccl_collective.h"
#include "kernels/staged_control_collective.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

using core::bf16_t;
using testing::DeviceBuffer;
using testing::MakeInputs;

// The survivor `rank` of a world-2 group whose other rank is lost, over a
// world-1 communicator on GPU 0, with all-gather scratch for captures of up
// to `capture_gather_bytes` per rank.
std::unique_ptr<MaskedStreamCollective> Survivor(int rank, int64_t capture_gather_bytes = 256) {
  auto id = NcclCollective::NewUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return nullptr;
  auto inner = NcclCollective::Create(*id, 0, 1, 0, std::chrono::seconds(30));
  EXPECT_TRUE(inner.ok()) << inner.status();
  if (!inner.ok()) return nullptr;
  std::vector<bool> live(2, false);
  live[rank] = true;
  auto masked = MaskedStreamCollective::Create(std::move(*inner), rank, live, capture_gather_bytes);
  EXPECT_TRUE(masked.ok()) << masked.status();
  return masked.ok() ? std::move(*masked) : nullptr;
}

TEST(MaskedStreamCollective, RejectsAnInnerThatDoesNotMatchTheMask) {
  MOE_EP_REQUIRE_GPUS(1);
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok());
  auto inner = NcclCollective::Create(*id, 0, 1, 0, std::chrono::seconds(30));
  ASSERT_TRUE(inner.ok()) << inner.status();
  // Both ranks live needs an inner of 2 ranks.
  const absl::Status both =
      MaskedStreamCollective::Create(std::move(*inner), 0, {true, true}, 256).status();
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument) << both;
  EXPECT_NE(both.message().find("expected rank 0 of 2"), absl::string_view::npos) << both;
  EXPECT_EQ(MaskedStreamCollective::Create(nullptr, 0, {true}, 256).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto id1 = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id1.ok());
  auto solo = NcclCollective::Create(*id1, 0, 1, 0, std::chrono::seconds(30));
  ASSERT_TRUE(solo.ok()) << solo.status();
  const absl::Status negative =
      MaskedStreamCollective::Create(std::move(*solo), 0, {true, false}, -1).status();
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument) << negative;
  EXPECT_NE(negative.message().find("capture_gather_bytes expected >= 0, got -1"),
            absl::string_view::npos)
      << negative;
}

// Rank `rank` live, the other lost: the live peer's bytes arrive through
// NCCL, the lost peer's part is this rank's own send part to it (a longer
// receive part zero-filled), the all-gather row of the lost rank is zero.
void CheckEchoAndZeroRows(int rank) {
  MOE_EP_REQUIRE_GPUS(1);
  std::unique_ptr<MaskedStreamCollective> coll = Survivor(rank);
  ASSERT_NE(coll, nullptr);
  const int lost = 1 - rank;
  EXPECT_EQ(coll->size(), 2);
  EXPECT_EQ(coll->rank(), rank);
  EXPECT_TRUE(coll->IsLive(rank));
  EXPECT_FALSE(coll->IsLive(lost));
  StagedControlCollective control(coll.get());
  EXPECT_FALSE(control.IsLive(lost));
  // send: 5 bytes to peer 0, 3 to peer 1; receive 5 from peer 0, 6 from 1
  // when rank 0 (the lost peer's part is longer than the echo).
  std::vector<int64_t> send_bytes = {5, 3};
  std::vector<int64_t> recv_bytes =
      rank == 0 ? std::vector<int64_t>{5, 6} : std::vector<int64_t>{2, 3};
  std::vector<uint8_t> send = {10, 11, 12, 13, 14, 20, 21, 22};
  DeviceBuffer<uint8_t> dsend(send);
  const int64_t recv_total = recv_bytes[0] + recv_bytes[1];
  DeviceBuffer<uint8_t> drecv(std::vector<uint8_t>(recv_total, 0xEE));
  ASSERT_TRUE(coll->AllToAllV(dsend.get(), send_bytes, drecv.get(), recv_bytes).ok());
  ASSERT_TRUE(coll->Synchronize().ok());
  // Self through NCCL: what this rank sent itself. Lost peer: the echo.
  const std::vector<uint8_t> want =
      rank == 0 ? std::vector<uint8_t>{10, 11, 12, 13, 14, 20, 21, 22, 0, 0, 0}
                : std::vector<uint8_t>{10, 11, 20, 21, 22};
  EXPECT_EQ(drecv.Download(recv_total), want);
  const int64_t mine[2] = {7 + rank, 40};
  std::vector<int64_t> all(4, -1);
  ASSERT_TRUE(control.AllGather(mine, sizeof(mine), all.data()).ok());
  std::vector<int64_t> want_all(4, 0);
  want_all[2 * rank] = 7 + rank;
  want_all[2 * rank + 1] = 40;
  EXPECT_EQ(all, want_all);
  std::vector<float> sum = {1.5f, -2.0f};
  ASSERT_TRUE(control.AllReduceSum(sum.data(), 2).ok());
  EXPECT_EQ(sum, (std::vector<float>{1.5f, -2.0f}));
  const int lost_only[1] = {lost};
  const absl::Status split = coll->Split(lost_only, "lost").status();
  EXPECT_EQ(split.code(), absl::StatusCode::kInvalidArgument) << split;
  EXPECT_NE(split.message().find("is masked"), absl::string_view::npos) << split;
  const int self[1] = {rank};
  auto solo = coll->Split(self, "solo");
  ASSERT_TRUE(solo.ok()) << solo.status();
  EXPECT_EQ((*solo)->size(), 1);
}

TEST(MaskedStreamCollective, Rank0SurvivesEchoAndZeroRows) { CheckEchoAndZeroRows(0); }
TEST(MaskedStreamCollective, Rank1SurvivesEchoAndZeroRows) { CheckEchoAndZeroRows(1); }

// The masked all-gather in a CUDA graph (global capture mode, where an
// allocation would invalidate the capture): captured once on scratch sized
// at Create (16 bytes per rank), replayed with new inputs, each replay gives
// this rank's row and a zero row for the lost rank. A gather over the
// capacity inside the capture is refused before it enqueues anything, and
// outside a capture it runs on grown scratch without disturbing the graph.
void CheckCapturedAllGather(int rank) {
  MOE_EP_REQUIRE_GPUS(1);
  std::unique_ptr<MaskedStreamCollective> coll = Survivor(rank, 16);
  ASSERT_NE(coll, nullptr);
  cudaStream_t stream = coll->stream();
  DeviceBuffer<int64_t> send(2);
  DeviceBuffer<int64_t> recv(4);
  DeviceBuffer<int64_t> wide_send(3);
  DeviceBuffer<int64_t> wide_recv(6);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const absl::Status captured = coll->AllGather(send.get(), 16, recv.get());
  const absl::Status over = coll->AllGather(wide_send.get(), 24, wide_recv.get());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(captured.ok()) << captured;
  EXPECT_EQ(over.code(), absl::StatusCode::kFailedPrecondition) << over;
  EXPECT_NE(over.message().find("24 bytes per rank inside a CUDA graph capture, more than the 16"),
            absl::string_view::npos)
      << over;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  const std::vector<std::vector<int64_t>> rounds = {{7 + rank, 40}, {-3, 1LL << 40}};
  for (size_t i = 0; i < rounds.size(); ++i) {
    send.Upload(rounds[i]);
    recv.Upload(std::vector<int64_t>(4, -1));
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_TRUE(coll->Synchronize().ok());
    std::vector<int64_t> want(4, 0);
    want[2 * rank] = rounds[i][0];
    want[2 * rank + 1] = rounds[i][1];
    EXPECT_EQ(recv.Download(4), want) << "replay " << i;
    // Between replays, a wider gather outside the capture (grown scratch).
    wide_send.Upload({5, 6, 7});
    ASSERT_TRUE(coll->AllGather(wide_send.get(), 24, wide_recv.get()).ok());
    ASSERT_TRUE(coll->Synchronize().ok());
    std::vector<int64_t> wide_want(6, 0);
    for (int j = 0; j < 3; ++j) wide_want[3 * rank + j] = 5 + j;
    EXPECT_EQ(wide_recv.Download(6), wide_want) << "after replay " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(MaskedStreamCollective, Rank0AllGatherIsCapturedOnCreateScratch) { CheckCapturedAllGather(0); }
TEST(MaskedStreamCollective, Rank1AllGatherIsCapturedOnCreateScratch) { CheckCapturedAllGather(1); }

// The GPU dispatcher of survivor `rank` in a world-2 group (8 experts,
// contiguous: 0-3 on rank 0, 4-7 on rank 1) whose other rank is lost: two
// masked Forward steps equal the CPU reference computed with the same mask
// (the lost rank's experts contribute zero), repeat bit for bit, and the
// load counters count every choice of this rank's tokens. `graph`: the
// step is captured once (CaptureForward at R = T) and the two steps are
// replays, so the masked echo runs inside a CUDA graph.
void RunMaskedDispatcher(int rank, bool graph) {
  MOE_EP_REQUIRE_GPUS(1);
  const int lost = 1 - rank;
  std::vector<bool> live(2, true);
  live[lost] = false;
  const int num_experts = 8;
  const core::PlacementTable table =
      core::PlacementTable::Contiguous(num_experts, 2)->WithMask(live).value();
  ASSERT_EQ(table.LostExperts().size(), 4u);
  const int64_t hidden = 256;
  const int64_t inter = 64;
  const int top_k = 2;
  const int64_t tokens = 80;
  std::vector<core::ExpertSet> sets;
  sets.reserve(2);
  for (int r = 0; r < 2; ++r) {
    sets.push_back(
        core::MakeHostExperts(core::ExpertSource::Seeded(11, 0, num_experts, 0, 0, hidden, inter)
                                  .WithExperts(core::DistinctSlotExperts(table, r)))
            .value());
  }
  const testing::MoeInputs in = MakeInputs(70 + rank, tokens, hidden, top_k, num_experts, 0.05);
  std::vector<core::EpRankInput> ref_inputs(2);
  ref_inputs[rank] = {in.hidden, in.ids, in.weights, tokens};
  ref_inputs[lost] = {{}, {}, {}, 0};
  auto ref = core::ReferenceEpForward(table, {&sets[0], &sets[1]}, ref_inputs, top_k);
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::unique_ptr<MaskedStreamCollective> coll = Survivor(rank);
  ASSERT_NE(coll, nullptr);
  GpuEpDispatcherOptions options;
  options.dispatcher.workspace = {2, tokens, hidden, top_k, core::DispatchDType::kBF16};
  options.dispatcher.num_experts = num_experts;
  options.max_intermediate = inter;
  if (graph) options.dispatcher.cuda_graph_buckets = {tokens};
  auto disp = GpuEpDispatcher::Create(coll.get(), options, 0);
  ASSERT_TRUE(disp.ok()) << disp.status();
  ASSERT_TRUE((*disp)->SetPlacement(table).ok());
  auto experts = DeviceExpertSet::Upload(sets[rank]);
  ASSERT_TRUE(experts.ok()) << experts.status();
  DeviceBuffer<bf16_t> x(in.hidden);
  DeviceBuffer<int32_t> ids(in.ids);
  DeviceBuffer<float> w(in.weights);
  DeviceBuffer<bf16_t> out(tokens * hidden);
  std::vector<std::vector<bf16_t>> outputs;
  if (graph) {
    const absl::Status s =
        (*disp)->CaptureForward(tokens, x.get(), ids.get(), w.get(), **experts, out.get());
    ASSERT_TRUE(s.ok()) << s;
  }
  for (int step = 1; step <= 2; ++step) {
    if (graph) {
      ASSERT_TRUE((*disp)->ReplayForward(tokens, step, tokens).ok());
      const absl::Status s = (*disp)->CheckReplay();
      ASSERT_TRUE(s.ok()) << s;
    } else {
      ASSERT_TRUE((*disp)->CommitGeometry(step, tokens, tokens).ok());
      const absl::Status s =
          (*disp)->Forward(x.get(), ids.get(), w.get(), tokens, **experts, out.get());
      ASSERT_TRUE(s.ok()) << s;
    }
    ASSERT_TRUE(coll->Synchronize().ok());
    outputs.push_back(out.Download(tokens * hidden));
  }
  EXPECT_EQ(outputs[0], outputs[1]) << "masked steps must repeat bit for bit";
  const std::vector<bf16_t>& want = ref->output[rank];
  ASSERT_EQ(want.size(), outputs[0].size());
  int64_t bad = 0;
  int64_t zero_rows = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    bool all_lost = true;
    for (int k = 0; k < top_k; ++k) {
      const int32_t id = in.ids[t * top_k + k];
      all_lost = all_lost && (id < 0 || id >= num_experts || !table.IsLive(id / 4));
    }
    for (int64_t h = 0; h < hidden; ++h) {
      const double g = core::Bf16ToFloat(outputs[0][t * hidden + h]);
      const double r = core::Bf16ToFloat(want[t * hidden + h]);
      if (!(std::abs(g - r) <= std::abs(r) / 32 + 2e-3)) ++bad;
      if (all_lost && g != 0.0) ++bad;  // only lost experts: exactly zero
    }
    zero_rows += all_lost;
  }
  EXPECT_EQ(bad, 0) << "rank " << rank << ": elements out of tolerance";
  EXPECT_GT(zero_rows, 0) << "the inputs must have tokens with only lost experts";
  std::vector<int64_t> expected(num_experts, 0);
  core::CountExpertTokens(in.ids, num_experts, absl::MakeSpan(expected));
  for (int64_t& c : expected) c *= 2;
  auto load = (*disp)->ReadExpertLoad(/*reset=*/true);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->tokens_per_expert, expected);
}

TEST(MaskedGpuDispatcher, Rank1LostStepsEqualMaskedReference) { RunMaskedDispatcher(0, false); }
TEST(MaskedGpuDispatcher, Rank0LostStepsEqualMaskedReference) { RunMaskedDispatcher(1, false); }
TEST(MaskedGpuDispatcher, Rank1LostGraphReplaysEqualMaskedReference) {
  RunMaskedDispatcher(0, true);
}
TEST(MaskedGpuDispatcher, Rank0LostGraphReplaysEqualMaskedReference) {
  RunMaskedDispatcher(1, true);
}

}  // namespace
}  // namespace moe_ep::kernels
