// The GPU data plane under a placement table (DESIGN §15; issue 17 items 1,
// 2 and 5): the route kernel reads the device table (replica = (token +
// rank) mod replicas, as core::PlacementTable::ChooseReplica) and bumps the
// device load counters; the pack kernel writes core::PayloadExpertId; the
// dispatcher at world 1 with replicas, and under EPLB's real output on the
// DeepSeek-V3 load, equals the CPU reference and counts tokens per logical
// expert exactly; ranks may hold any set of ids (DESIGN §17, issue 34 item
// 2). Kernel tests need one GPU (ep_size is a kernel argument there);
// dispatcher cases need ep_size GPUs. Without them every test skips with
// the reason printed.

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/eplb.h"
#include "core/expert_load_file.h"
#include "core/expert_source.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
#include "core/routing.h"
#include "core/routing_source.h"
#include "kernels/device_experts.h"
#include "kernels/dispatch_pack.cuh"
#include "kernels/gpu_ep_dispatcher.h"
#include "kernels/nccl_collective.h"
#include "kernels/route.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace placement_test {
namespace {

using core::bf16_t;
using testing::DeviceBuffer;
using testing::MakeInputs;

core::PlacementTable Table(int num_experts, std::vector<std::vector<int>> slots) {
  return core::PlacementTable::FromSlotExperts(num_experts, std::move(slots)).value();
}

// The device form of a table (as GpuEpDispatcher::SetPlacement writes it):
// replica offsets [E + 1], the live replicas' ranks (all of them unmasked).
struct HostTable {
  std::vector<int32_t> offsets;
  std::vector<int32_t> ranks;
  explicit HostTable(const core::PlacementTable& table) {
    offsets.push_back(0);
    for (int e = 0; e < table.num_experts(); ++e) {
      for (const core::ReplicaSlot& r : table.LiveReplicas(e)) ranks.push_back(r.rank);
      offsets.push_back(static_cast<int32_t>(ranks.size()));
    }
  }
};

// HostTable uploaded; At(source) is the kernels' view of it for a source rank.
struct DeviceTable {
  explicit DeviceTable(const HostTable& host) : offsets(host.offsets), ranks(host.ranks) {}
  DevicePlacement At(int source) const { return {offsets.get(), ranks.get(), source}; }
  DeviceBuffer<int32_t> offsets;
  DeviceBuffer<int32_t> ranks;
};

// 4 ranks, 8 experts, 3 slots a rank: 7 on ranks 0 and 1, 0 and 6 twice, 5
// twice on rank 2.
core::PlacementTable FourRankTable() {
  return Table(8, {{7, 0, 3}, {1, 7, 6}, {2, 5, 5}, {4, 6, 0}});
}

// One step's inputs of the 8-expert, 4-rank cases on the device, with the
// route kernel's outputs: token_slot [tokens, 4] and send_counts [4].
struct DeviceStep {
  DeviceStep(const testing::MoeInputs& in, int64_t tokens)
      : x(in.hidden),
        ids(in.ids),
        w(in.weights),
        t(std::vector<int64_t>{tokens}),
        slots(tokens * 4),
        counts(4) {}
  DeviceBuffer<bf16_t> x;
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> w;
  DeviceBuffer<int64_t> t;
  DeviceBuffer<int32_t> slots;
  DeviceBuffer<int32_t> counts;
};

// Route parameters of the 8-expert, 4-rank cases over `step`'s buffers for
// `rows` tokens under `placement`, fields by name.
RouteParams Params(const DeviceStep& step, int64_t rows, int top_k,
                   const DevicePlacement& placement) {
  RouteParams p;
  p.topk_ids = step.ids.get();
  p.num_tokens = step.t.get();
  p.max_tokens = rows;
  p.top_k = top_k;
  p.num_experts = 8;
  p.ep_size = 4;
  p.token_slot = step.slots.get();
  p.send_counts = step.counts.get();
  p.placement = placement;
  return p;
}

// Pack parameters of the 8-expert, 4-rank cases over `step` (routed
// already) into `send` [4, tokens, DispatchRowBytes(hidden, top_k)].
PackDispatchParams Pack(const DeviceStep& step, int64_t tokens, int64_t hidden, int top_k,
                        uint8_t* send, const DevicePlacement& placement) {
  PackDispatchParams pack;
  pack.hidden = step.x.get();
  pack.topk_ids = step.ids.get();
  pack.topk_weights = step.w.get();
  pack.token_slot = step.slots.get();
  pack.send_counts = step.counts.get();
  pack.num_tokens = step.t.get();
  pack.max_tokens = tokens;
  pack.hidden_size = hidden;
  pack.top_k = top_k;
  pack.ep_size = 4;
  pack.invalid_expert_id = -1;
  pack.send = send;
  pack.placement = placement;
  pack.num_experts = 8;
  return pack;
}

// The token_slot [tokens, 4] the route kernel writes for the CPU `route`:
// each token's slot at every rank it goes to, -1 elsewhere.
std::vector<int32_t> WantSlots(const core::DispatchRoute& route, int64_t tokens) {
  std::vector<int32_t> want(tokens * 4, -1);
  for (int64_t tok = 0; tok < tokens; ++tok) {
    for (int64_t i = route.token_offsets[tok]; i < route.token_offsets[tok + 1]; ++i) {
      want[tok * 4 + route.dest_rank[i]] = static_cast<int32_t>(route.dest_slot[i]);
    }
  }
  return want;
}

TEST(LaunchRouteTable, MatchesCpuRoutingAndCountsTokensPerExpert) {
  MOE_EP_REQUIRE_GPUS(1);
  const core::PlacementTable table = FourRankTable();
  const DeviceTable device_table{HostTable(table)};
  const int64_t tokens = 777;
  const int top_k = 3;
  auto in = MakeInputs(21, tokens, 4, top_k, 8, 0.1);
  const DeviceStep step(in, tokens);
  DeviceBuffer<unsigned long long> load(std::vector<unsigned long long>(8, 0));
  std::vector<int64_t> expected_load(8, 0);
  for (int source = 0; source < 4; ++source) {
    RouteParams p = Params(step, tokens, top_k, device_table.At(source));
    p.expert_tokens = load.get();
    ASSERT_TRUE(LaunchRoute(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto route = core::ComputeDispatchRoute(in.ids, tokens, top_k, table, source);
    ASSERT_TRUE(route.ok()) << route.status();
    const auto got_counts = step.counts.Download(4);
    for (int d = 0; d < 4; ++d) EXPECT_EQ(got_counts[d], route->send_counts[d]) << d;
    EXPECT_EQ(step.slots.Download(tokens * 4), WantSlots(*route, tokens)) << "source " << source;
    core::CountExpertTokens(in.ids, 8, absl::MakeSpan(expected_load));
  }
  // Four launches accumulated: four times each expert's count.
  const auto got_load = load.Download(8);
  for (int e = 0; e < 8; ++e) EXPECT_EQ(static_cast<int64_t>(got_load[e]), expected_load[e]) << e;
}

TEST(LaunchPackDispatchTable, MasksChoicesServedByAnotherReplica) {
  MOE_EP_REQUIRE_GPUS(1);
  const core::PlacementTable table = FourRankTable();
  const DeviceTable device_table{HostTable(table)};
  const int64_t tokens = 200;
  const int top_k = 3;
  const int64_t hidden = 8;
  const int source = 2;
  auto in = MakeInputs(22, tokens, hidden, top_k, 8, 0.1);
  const DeviceStep step(in, tokens);
  const DevicePlacement placement = device_table.At(source);
  ASSERT_TRUE(LaunchRoute(Params(step, tokens, top_k, placement), nullptr).ok());
  const int64_t row_bytes = DispatchRowBytes(hidden, top_k);
  DeviceBuffer<uint8_t> send(4 * tokens * row_bytes);
  ASSERT_TRUE(
      LaunchPackDispatch(Pack(step, tokens, hidden, top_k, send.get(), placement), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto rows = send.Download(4 * tokens * row_bytes);
  auto cpu = core::ComputeDispatchRoute(in.ids, tokens, top_k, table, source).value();
  int64_t masked = 0;
  for (int64_t tok = 0; tok < tokens; ++tok) {
    for (int64_t i = cpu.token_offsets[tok]; i < cpu.token_offsets[tok + 1]; ++i) {
      const int d = cpu.dest_rank[i];
      const uint8_t* row = rows.data() + (d * tokens + cpu.dest_slot[i]) * row_bytes;
      for (int k = 0; k < top_k; ++k) {
        int32_t got = 0;
        std::memcpy(&got, row + 2 * hidden + 4 * k, 4);
        const int32_t want =
            core::PayloadExpertId(table, source, tok, in.ids[tok * top_k + k], d, -1);
        EXPECT_EQ(got, want) << "token " << tok << " dest " << d << " choice " << k;
        masked += want != in.ids[tok * top_k + k];
      }
    }
  }
  EXPECT_GT(masked, 0) << "the inputs must exercise the mask";
}

// Issue 17 item 3 on the GPU: under a rank mask (rank 1 of FourRankTable
// lost: expert 1 has no live replica, 6 and 7 keep theirs on ranks 3 and 0)
// the route kernel sends nothing to the masked rank, the pack kernel
// carries the lost expert's id as invalid in every copy, and both equal the
// CPU route and payload ids of the masked table.
TEST(LaunchRouteTable, RankMaskSendsNothingToMaskedRankAndDropsLostExperts) {
  MOE_EP_REQUIRE_GPUS(1);
  const core::PlacementTable table = FourRankTable().WithMask({true, false, true, true}).value();
  ASSERT_EQ(table.LostExperts(), std::vector<int>{1});
  const DeviceTable device_table{HostTable(table)};
  const int64_t tokens = 300;
  const int top_k = 3;
  const int64_t hidden = 8;
  auto in = MakeInputs(23, tokens, hidden, top_k, 8, 0.1);
  const DeviceStep step(in, tokens);
  const int64_t row_bytes = DispatchRowBytes(hidden, top_k);
  DeviceBuffer<uint8_t> send(4 * tokens * row_bytes);
  int64_t lost_choices = 0;
  for (const int source : {0, 2, 3}) {
    const DevicePlacement placement = device_table.At(source);
    ASSERT_TRUE(LaunchRoute(Params(step, tokens, top_k, placement), nullptr).ok());
    ASSERT_TRUE(
        LaunchPackDispatch(Pack(step, tokens, hidden, top_k, send.get(), placement), nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto cpu = core::ComputeDispatchRoute(in.ids, tokens, top_k, table, source);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    const auto got_counts = step.counts.Download(4);
    EXPECT_EQ(got_counts[1], 0) << "source " << source << " sent tokens to the masked rank";
    for (int d = 0; d < 4; ++d) EXPECT_EQ(got_counts[d], cpu->send_counts[d]) << d;
    EXPECT_EQ(step.slots.Download(tokens * 4), WantSlots(*cpu, tokens)) << "source " << source;
    const auto rows = send.Download(4 * tokens * row_bytes);
    for (int64_t tok = 0; tok < tokens; ++tok) {
      for (int64_t i = cpu->token_offsets[tok]; i < cpu->token_offsets[tok + 1]; ++i) {
        const int d = cpu->dest_rank[i];
        const uint8_t* row = rows.data() + (d * tokens + cpu->dest_slot[i]) * row_bytes;
        for (int k = 0; k < top_k; ++k) {
          int32_t got = 0;
          std::memcpy(&got, row + 2 * hidden + 4 * k, 4);
          const int32_t id = in.ids[tok * top_k + k];
          EXPECT_EQ(got, core::PayloadExpertId(table, source, tok, id, d, -1))
              << "source " << source << " token " << tok << " dest " << d << " choice " << k;
          if (id == 1) {
            EXPECT_EQ(got, -1) << "lost expert 1 must reach no rank's experts";
            ++lost_choices;
          }
        }
      }
    }
  }
  EXPECT_GT(lost_choices, 0) << "the inputs must route lost expert 1 in a copy to a live rank";
}

void RunRanks(int ep_size, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  threads.reserve(ep_size);
  for (int r = 0; r < ep_size; ++r) {
    threads.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      body(r);
    });
  }
  for (auto& th : threads) th.join();
}

// GpuEpDispatcher with `table` installed on ep_size GPUs: two Forward steps
// of seeded SwiGLU experts (each rank's its distinct slot experts, any set
// of ids), output against the CPU reference under the table, load counters
// against the ids counted on the host. The top-k ids and weights are
// uniform (MakeInputs), or drawn from `routing` at `layer` when given.
void RunTableCase(const core::PlacementTable& table, int redundant, int top_k = 2,
                  const core::RoutingSource* routing = nullptr, int layer = 0) {
  const int ep = table.ep_size();
  MOE_EP_REQUIRE_GPUS(ep);
  const int num_experts = table.num_experts();
  const int64_t hidden = 256;
  const int64_t inter = 64;
  std::vector<core::ExpertSet> sets;
  sets.reserve(ep);
  for (int r = 0; r < ep; ++r) {
    sets.push_back(
        core::MakeHostExperts(core::ExpertSource::Seeded(9, 0, num_experts, 0, 0, hidden, inter)
                                  .WithExperts(core::DistinctSlotExperts(table, r)))
            .value());
  }
  std::vector<testing::MoeInputs> inputs;
  inputs.reserve(ep);
  std::vector<core::EpRankInput> ref_inputs;
  std::vector<const core::ExpertSet*> set_ptrs;
  const int64_t tokens = 96;
  for (int r = 0; r < ep; ++r) {
    inputs.push_back(MakeInputs(60 + r, tokens, hidden, top_k, num_experts, 0.05));
    if (routing != nullptr) {
      absl::StatusOr<core::Routing> drawn = routing->Generate(layer, 0, r, ep, tokens);
      ASSERT_TRUE(drawn.ok()) << drawn.status();
      inputs.back().ids = drawn->topk_ids;
      inputs.back().weights = drawn->topk_weights;
    }
  }
  for (int r = 0; r < ep; ++r) {
    ref_inputs.push_back({inputs[r].hidden, inputs[r].ids, inputs[r].weights, tokens});
    set_ptrs.push_back(&sets[r]);
  }
  auto ref = core::ReferenceEpForward(table, set_ptrs, ref_inputs, top_k);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  RunRanks(ep, [&](int rank) {
    auto coll = NcclCollective::Create(*id, rank, ep, rank, std::chrono::seconds(60));
    ASSERT_TRUE(coll.ok()) << coll.status();
    GpuEpDispatcherOptions options;
    options.dispatcher.workspace = {ep, tokens, hidden, top_k, core::DispatchDType::kBF16};
    options.dispatcher.num_experts = num_experts;
    options.dispatcher.redundant_slots_per_rank = redundant;
    options.max_intermediate = inter;
    auto disp = GpuEpDispatcher::Create(coll->get(), options, 0);
    ASSERT_TRUE(disp.ok()) << disp.status();
    absl::Status set = (*disp)->SetPlacement(table);
    ASSERT_TRUE(set.ok()) << set;
    EXPECT_EQ((*disp)->placement_fingerprint(), table.Fingerprint());
    auto experts = DeviceExpertSet::Upload(sets[rank]);
    ASSERT_TRUE(experts.ok()) << experts.status();
    DeviceBuffer<bf16_t> x(inputs[rank].hidden);
    DeviceBuffer<int32_t> ids(inputs[rank].ids);
    DeviceBuffer<float> w(inputs[rank].weights);
    DeviceBuffer<bf16_t> out(tokens * hidden);
    std::vector<std::vector<bf16_t>> outputs;
    for (int step = 1; step <= 2; ++step) {
      ASSERT_TRUE((*disp)->CommitGeometry(step, tokens, tokens).ok());
      absl::Status s = (*disp)->Forward(x.get(), ids.get(), w.get(), tokens, **experts, out.get());
      ASSERT_TRUE(s.ok()) << s;
      ASSERT_TRUE((*coll)->Synchronize().ok());
      outputs.push_back(out.Download(tokens * hidden));
    }
    EXPECT_EQ(outputs[0], outputs[1]) << "rank " << rank << ": steps must repeat bit for bit";
    const std::vector<bf16_t>& want = ref->output[rank];
    int64_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double g = core::Bf16ToFloat(outputs[0][i]);
      const double r = core::Bf16ToFloat(want[i]);
      if (!(std::abs(g - r) <= std::abs(r) / 32 + 2e-3)) ++bad;
    }
    EXPECT_EQ(bad, 0) << "rank " << rank << ": elements out of tolerance";
    // Load statistics: both steps' (token, choice) pairs of this rank.
    std::vector<int64_t> expected(num_experts, 0);
    core::CountExpertTokens(inputs[rank].ids, num_experts, absl::MakeSpan(expected));
    for (int64_t& c : expected) c *= 2;
    auto load = (*disp)->ReadExpertLoad(/*reset=*/true);
    ASSERT_TRUE(load.ok()) << load.status();
    EXPECT_EQ(load->steps, 2);
    EXPECT_EQ(load->tokens_per_expert, expected);
    auto after = (*disp)->ReadExpertLoad(false);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->tokens_per_expert, std::vector<int64_t>(num_experts, 0));
  });
}

// World 1: 8 experts on 10 slots (experts 3 and 6 twice).
TEST(GpuEpDispatcherPlacement, World1WithReplicasEqualsReferenceAndCounts) {
  RunTableCase(Table(8, {{0, 1, 2, 3, 3, 4, 5, 6, 6, 7}}), 2);
}

// Two ranks (registered for a 2-GPU machine): expert 3 on both, twice on
// rank 0; rank 1 holds {3, 4, 5, 6, 7}.
TEST(GpuEpDispatcherPlacement, World2WithReplicasEqualsReferenceAndCounts) {
  RunTableCase(Table(8, {{0, 1, 2, 3, 3}, {4, 5, 6, 7, 3}}), 1);
}

// Two ranks whose experts are not ranges (DESIGN §17; issue 34 item 2; a
// 2-GPU machine): rank 0 {0, 2, 5, 7}, rank 1 {1, 3, 4, 6, 7}.
TEST(GpuEpDispatcherPlacement, World2IdsThatAreNotRangesEqualReferenceAndCounts) {
  RunTableCase(Table(8, {{0, 2, 5, 7, 0}, {1, 3, 4, 6, 7}}), 1);
}

std::string DataDir() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  return (env != nullptr && *env != '\0') ? env : MOE_EP_DATA_DIR;
}

// EPLB's real output on the DeepSeek-V3 load (issue 34 item 2): layer 10
// of SGLang's prefill statistics, 256 experts on `ep` ranks with 32
// redundant slots (core::RebalanceHierarchical, 8 groups, one node), top-8
// choices drawn from the same load; Forward under the table equals the CPU
// reference and the device counters count every choice. At world 1 the
// rank holds all 256 experts with the 32 hottest twice; at world 2 and 4
// (machines of that many GPUs) the ranks hold ids that are not ranges.
void RunEplbCase(int ep) {
  MOE_EP_REQUIRE_GPUS(ep);
  const std::string file = DataDir() + "/traces/sglang_ep_statistics_deepseek/prefill_in4096.json";
  if (!std::filesystem::exists(file)) GTEST_SKIP() << "DeepSeek-V3 load not found at " << file;
  const int layer = 10;
  auto load = core::ReadExpertLoadFile(file);
  ASSERT_TRUE(load.ok()) << load.status();
  auto table = core::RebalanceHierarchical((*load)[layer], {256 + 32, ep, 8, 1});
  ASSERT_TRUE(table.ok()) << table.status();
  int replicated = 0;
  for (int e = 0; e < 256; ++e) replicated += table->Replicas(e).size() > 1;
  ASSERT_GT(replicated, 0) << "EPLB must replicate the hottest experts";
  if (ep > 1) {
    int not_ranges = 0;
    for (int r = 0; r < ep; ++r) {
      const std::vector<int> held = core::DistinctSlotExperts(*table, r);
      not_ranges += held.back() - held.front() + 1 != static_cast<int>(held.size());
    }
    ASSERT_GT(not_ranges, 0) << "EPLB's ranks must hold ids that are not ranges";
  }
  core::RoutingSourceOptions routing;
  routing.kind = "load:" + file;
  routing.num_experts = 256;
  routing.top_k = 8;
  routing.seed = 3;
  auto source = core::RoutingSource::Create(routing);
  ASSERT_TRUE(source.ok()) << source.status();
  RunTableCase(*table, 32 / ep, 8, &*source, layer);
}

TEST(GpuEpDispatcherPlacement, World1EplbDeepSeekV3LoadEqualsReferenceAndCounts) { RunEplbCase(1); }
TEST(GpuEpDispatcherPlacement, World2EplbDeepSeekV3LoadEqualsReferenceAndCounts) { RunEplbCase(2); }
TEST(GpuEpDispatcherPlacement, World4EplbDeepSeekV3LoadEqualsReferenceAndCounts) { RunEplbCase(4); }

TEST(GpuEpDispatcherPlacement, RejectsTablesTheDeviceExpertSetCannotHold) {
  MOE_EP_REQUIRE_GPUS(1);
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok());
  auto coll = NcclCollective::Create(*id, 0, 1, 0, std::chrono::seconds(30));
  ASSERT_TRUE(coll.ok()) << coll.status();
  GpuEpDispatcherOptions options;
  options.dispatcher.workspace = {1, 16, 64, 2, core::DispatchDType::kBF16};
  options.dispatcher.num_experts = 4;
  options.dispatcher.redundant_slots_per_rank = 1;
  auto disp = GpuEpDispatcher::Create(coll->get(), options, 0);
  ASSERT_TRUE(disp.ok()) << disp.status();
  const uint64_t contiguous = (*disp)->placement_fingerprint();
  EXPECT_EQ(contiguous, core::PlacementTable::Contiguous(4, 1)->Fingerprint());
  // 6 slots: beyond the budget of 4 + 1.
  absl::Status over = (*disp)->SetPlacement(Table(4, {{0, 1, 2, 3, 0, 1}}));
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument) << over;
  EXPECT_EQ((*disp)->placement_fingerprint(), contiguous);
}

}  // namespace
}  // namespace placement_test
}  // namespace moe_ep::kernels
