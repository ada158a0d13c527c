#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/onesided/peer_window.h"
#include "tests/kernels/onesided_test_util.h"

// A rank alone's engine dispatch on the one-sided plane, unpacked straight
// into the engine's buffers by the send kernel (OsDispatchParams::
// direct_unpack, issue 30 item 3), against the window path it replaces
// (MOE_EP_ONESIDED_DIRECT_UNPACK=0) and a host reference: every slot's
// hidden row, ids and weights, the padding slots [count, rows) over
// buffers holding another step's bytes, the per-source and per-expert
// counts, and the combine of the unpacked rows (each token back as it was,
// zero for a token with no valid id).

namespace moe_ep::kernels::onesided {
namespace {

using core::bf16_t;
using testing::OsCase;

struct EngineOut {
  std::vector<bf16_t> hidden;  // [rows, H]
  std::vector<int32_t> ids;    // [rows, K]
  std::vector<float> weights;  // [rows, K]
  std::vector<int64_t> source_counts;
  std::vector<int64_t> expert_counts;
  std::vector<bf16_t> combined;  // [T, H]
};

struct Inputs {
  std::vector<bf16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Seeded inputs in which every 5th token selects no expert (all K ids are
// the invalid id: it is not sent, so later tokens' slots move up) and
// every 3rd token has one invalid choice.
Inputs MakeCase(const OsCase& c, int64_t tokens) {
  const testing::MoeInputs in =
      testing::MakeInputs(c.seed, tokens, c.hidden, c.top_k, c.num_experts, 0.0, c.invalid_id);
  Inputs out{in.hidden, in.ids, in.weights};
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < c.top_k; ++k) {
      if (t % 5 == 4 || (t % 3 == 1 && k == 1)) out.ids[t * c.top_k + k] = c.invalid_id;
    }
  }
  return out;
}

// Two dispatch + combine steps through a fresh world-1 dispatcher with the
// direct unpack on or off: first R tokens that all select an expert (every
// receive slot below R filled), then `in`, into engine buffers of `rows`
// slots filled with 0x5a bytes before each step (another step's rows) and
// counts of 777. Returns the second step's buffers.
EngineOut RunEngineStep(const OsCase& c, const Inputs& in, int64_t tokens, int64_t r, int64_t rows,
                        bool direct) {
  EngineOut got;
  EXPECT_EQ(setenv("MOE_EP_ONESIDED_DIRECT_UNPACK", direct ? "1" : "0", 1), 0);
  auto bytes = OneSidedDispatcher::WindowBytes(testing::EpOptions(c, r));
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  auto group = ThreadWindowGroup::Create(1);
  EXPECT_TRUE(group.ok()) << group.status();
  if (!bytes.ok() || !group.ok()) return got;
  auto windows = (*group)->Join(0, 0, *bytes, absl::Seconds(60));
  EXPECT_TRUE(windows.ok()) << windows.status();
  if (!windows.ok()) return got;
  auto d = OneSidedDispatcher::Create(windows->get(), testing::Options(c, r), 0);
  unsetenv("MOE_EP_ONESIDED_DIRECT_UNPACK");
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return got;
  const int64_t H = c.hidden;
  const int K = c.top_k;
  const int L = c.num_experts;
  const testing::MoeInputs first =
      testing::MakeInputs(c.seed + 1, r, H, K, c.num_experts, 0.0, c.invalid_id);
  testing::DeviceBuffer<bf16_t> hidden(std::max(first.hidden.size(), in.hidden.size()));
  testing::DeviceBuffer<int32_t> ids(std::max(first.ids.size(), in.ids.size()));
  testing::DeviceBuffer<float> weights(std::max(first.weights.size(), in.weights.size()));
  testing::DeviceBuffer<bf16_t> recv_hidden(rows * H);
  testing::DeviceBuffer<int32_t> recv_ids(rows * K);
  testing::DeviceBuffer<float> recv_weights(rows * K);
  testing::DeviceBuffer<int64_t> source_counts(1);
  testing::DeviceBuffer<int64_t> expert_counts(L);
  const int64_t out_rows = std::max<int64_t>(std::max(tokens, r), 1);
  testing::DeviceBuffer<bf16_t> combined(out_rows * H);
  OsZeroCounts zero;
  zero.ptr[0] = source_counts.get();
  zero.n[0] = 1;
  zero.ptr[1] = expert_counts.get();
  zero.n[1] = L;
  UnpackReceivedParams u;
  u.recv = (*d)->received_rows();
  u.runtime_max = r;
  u.rows = rows;
  u.hidden_size = H;
  u.top_k = K;
  u.ep_size = 1;
  u.first_expert = 0;
  u.num_local_experts = L;
  u.invalid_expert_id = c.invalid_id;
  u.hidden = recv_hidden.get();
  u.topk_ids = recv_ids.get();
  u.topk_weights = recv_weights.get();
  u.source_counts = source_counts.get();
  u.expert_counts = expert_counts.get();
  u.counts_zeroed = true;
  std::vector<int32_t> stale_ids(rows * K);
  std::memset(stale_ids.data(), 0x5a, stale_ids.size() * sizeof(int32_t));
  std::vector<float> stale_weights(rows * K);
  std::memset(stale_weights.data(), 0x5a, stale_weights.size() * sizeof(float));
  auto step = [&](int64_t epoch, const testing::MoeInputs& x, int64_t t) {
    hidden.Upload(x.hidden);
    ids.Upload(x.ids);
    weights.Upload(x.weights);
    recv_hidden.Upload(std::vector<bf16_t>(rows * H, 0x5a5a));
    recv_ids.Upload(stale_ids);
    recv_weights.Upload(stale_weights);
    source_counts.Upload(std::vector<int64_t>(1, 777));
    expert_counts.Upload(std::vector<int64_t>(L, 777));
    combined.Upload(std::vector<bf16_t>(out_rows * H, 0xffff));
    EXPECT_TRUE((*d)->CommitGeometry(epoch, r, t).ok());
    const absl::Status dispatched =
        (*d)->Dispatch(hidden.get(), ids.get(), weights.get(), t, zero, &u);
    EXPECT_TRUE(dispatched.ok()) << dispatched;
    const absl::Status combined_status = (*d)->CombineFrom(recv_hidden.get(), rows, combined.get());
    EXPECT_TRUE(combined_status.ok()) << combined_status;
    const absl::Status checked = (*d)->CheckStep();
    EXPECT_TRUE(checked.ok()) << checked;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  };
  step(1, first, r);
  step(2, {in.hidden, in.ids, in.weights}, tokens);
  got.hidden = recv_hidden.Download(rows * H);
  got.ids = recv_ids.Download(rows * K);
  got.weights = recv_weights.Download(rows * K);
  got.source_counts = source_counts.Download(1);
  got.expert_counts = expert_counts.Download(L);
  got.combined = combined.Download(tokens * H);
  return got;
}

// The engine's buffers as LaunchUnpackReceived's contract has them, from
// the inputs alone: the tokens with a valid id in token order, then padding.
EngineOut Reference(const OsCase& c, const Inputs& in, int64_t tokens, int64_t rows) {
  const int64_t H = c.hidden;
  const int K = c.top_k;
  EngineOut want;
  want.hidden.assign(rows * H, 0);
  want.ids.assign(rows * K, c.invalid_id);
  want.weights.assign(rows * K, 0.0f);
  want.expert_counts.assign(c.num_experts, 0);
  want.combined.assign(tokens * H, 0);
  int64_t slot = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    bool sent = false;
    for (int k = 0; k < K; ++k) {
      const int32_t id = in.ids[t * K + k];
      if (id == c.invalid_id) continue;
      ++want.expert_counts[id];
      sent = true;
    }
    if (!sent) continue;
    std::copy_n(&in.hidden[t * H], H, &want.hidden[slot * H]);
    std::copy_n(&in.ids[t * K], K, &want.ids[slot * K]);
    std::copy_n(&in.weights[t * K], K, &want.weights[slot * K]);
    std::copy_n(&in.hidden[t * H], H, &want.combined[t * H]);
    ++slot;
  }
  want.source_counts = {slot};
  return want;
}

void ExpectSame(const EngineOut& got, const EngineOut& want, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(got.source_counts, want.source_counts);
  EXPECT_EQ(got.expert_counts, want.expert_counts);
  EXPECT_EQ(got.ids, want.ids);
  ASSERT_EQ(got.weights.size(), want.weights.size());
  EXPECT_EQ(std::memcmp(got.weights.data(), want.weights.data(), 4 * want.weights.size()), 0)
      << "weights differ";
  ASSERT_EQ(got.hidden.size(), want.hidden.size());
  int64_t first_bad = -1;
  for (size_t i = 0; i < want.hidden.size() && first_bad < 0; ++i) {
    if (got.hidden[i] != want.hidden[i]) first_bad = static_cast<int64_t>(i);
  }
  EXPECT_EQ(first_bad, -1) << "hidden differs first at element " << first_bad;
  EXPECT_EQ(got.combined, want.combined) << "combined output differs";
}

void RunDirectVsWindow(const OsCase& c, int64_t tokens, int64_t r, int64_t rows) {
  MOE_EP_REQUIRE_GPUS(1);
  const Inputs in = MakeCase(c, tokens);
  const EngineOut want = Reference(c, in, tokens, rows);
  ASSERT_GT(want.source_counts[0], 0);
  ASSERT_LT(want.source_counts[0], tokens);  // some tokens were not sent
  ExpectSame(RunEngineStep(c, in, tokens, r, rows, true), want, "direct unpack");
  ExpectSame(RunEngineStep(c, in, tokens, r, rows, false), want, "window path");
}

// The shape: H 7168, top-8, 256 experts, 113 tokens at R 128 into
// 160 slots (padding below and above R).
TEST(OneSidedDirectUnpack, H7168Top8E256MatchesWindowPathAndReference) {
  RunDirectVsWindow({1, 7168, 8, 256, {113}, -1, 0.0}, 113, 128, 160);
}
// Odd top-k (8-byte vectors on the send side), the invalid id num_experts
// (DESIGN §7's other convention), T == R == rows.
TEST(OneSidedDirectUnpack, OddTopKInvalidIdNumExpertsAllSlotsUsed) {
  RunDirectVsWindow({1, 2048, 3, 64, {64}, 64, 0.0}, 64, 64, 64);
}

}  // namespace
}  // namespace moe_ep::kernels::onesided
