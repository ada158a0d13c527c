#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/onesided/peer_window.h"
#include "tests/kernels/onesided_test_util.h"

// An engine's dispatch on the one-sided plane with the direct unpack (the
// send kernel writes a rank's own rows straight into the engine's buffers;
// OsDispatchParams::direct_unpack, issue 30 item 3) against the window path
// it replaces (MOE_EP_ONESIDED_DIRECT_UNPACK=0) and a host reference, with
// ranks as threads sharing GPU 0: every slot's hidden row, ids and weights,
// the padding slots [count, rows) over buffers holding another step's
// bytes, the per-source and per-expert counts, and the combine of the
// unpacked rows (each token back times the ranks it went to, zero for a
// token with no valid id). Two steps per dispatcher, the second sending
// fewer rows than the first, so the window holds stale rows past the
// counts. At and past the copy-engine threshold too (an engine's step
// takes the SM path). And into the window's receive buffers, where the
// peers store their rows in place (OsDispatchParams::peer_direct), with a
// group whose ranks choose differently refused as a mismatch.

namespace moe_ep::kernels::onesided {
namespace {

using core::bf16_t;
using testing::MoeInputs;
using testing::OsCase;

struct EngineOut {
  std::vector<bf16_t> hidden;  // [E, rows, H]
  std::vector<int32_t> ids;    // [E, rows, K]
  std::vector<float> weights;  // [E, rows, K]
  std::vector<int64_t> source_counts;
  std::vector<int64_t> expert_counts;
  std::vector<bf16_t> combined;  // [T, H]
};

// Seeded inputs of rank `rank` in which every 5th token selects no expert
// (all K ids are the invalid id: it is sent nowhere, so later tokens' slots
// move up) and every 3rd token has one invalid choice.
MoeInputs MakeCase(const OsCase& c, int rank, int64_t tokens) {
  MoeInputs in = testing::MakeInputs(c.seed + 10 * rank, tokens, c.hidden, c.top_k, c.num_experts,
                                     0.0, c.invalid_id);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < c.top_k; ++k) {
      if (t % 5 == 4 || (t % 3 == 1 && k == 1)) in.ids[t * c.top_k + k] = c.invalid_id;
    }
  }
  return in;
}

// The experts of rank d: contiguous, num_experts / E each.
int FirstExpert(const OsCase& c, int d) { return d * (c.num_experts / c.ep_size); }
int LocalExperts(const OsCase& c) { return c.num_experts / c.ep_size; }

// Rank `me`'s engine buffers and combined output, from the inputs alone:
// slab s holds the tokens of source s with an id of rank me, in token order,
// then padding; a token comes back times the ranks it was sent to.
EngineOut Reference(const OsCase& c, const std::vector<MoeInputs>& in, int me, int64_t rows) {
  const int64_t H = c.hidden;
  const int K = c.top_k;
  const int E = c.ep_size;
  const int L = LocalExperts(c);
  EngineOut want;
  want.hidden.assign(E * rows * H, 0);
  want.ids.assign(E * rows * K, c.invalid_id);
  want.weights.assign(E * rows * K, 0.0f);
  want.source_counts.assign(E, 0);
  want.expert_counts.assign(L, 0);
  auto owner = [&](int32_t id) { return id == c.invalid_id ? -1 : id / L; };
  for (int s = 0; s < E; ++s) {
    const int64_t tokens = c.tokens[s];
    int64_t slot = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      bool here = false;
      for (int k = 0; k < K; ++k) {
        const int32_t id = in[s].ids[t * K + k];
        if (owner(id) != me) continue;
        ++want.expert_counts[id - FirstExpert(c, me)];
        here = true;
      }
      if (!here) continue;
      const int64_t at = s * rows + slot;
      std::copy_n(&in[s].hidden[t * H], H, &want.hidden[at * H]);
      std::copy_n(&in[s].ids[t * K], K, &want.ids[at * K]);
      std::copy_n(&in[s].weights[t * K], K, &want.weights[at * K]);
      ++slot;
    }
    want.source_counts[s] = slot;
  }
  const int64_t tokens = c.tokens[me];
  want.combined.assign(tokens * H, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    int ranks = 0;
    for (int d = 0; d < E; ++d) {
      bool to_d = false;
      for (int k = 0; k < K; ++k) to_d = to_d || owner(in[me].ids[t * K + k]) == d;
      ranks += to_d ? 1 : 0;
    }
    // n * x in fp32, rounded to bf16: exact for n <= 2. A token sent
    // nowhere comes back as +0 (0 * x would be -0 for a negative x).
    if (ranks == 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      want.combined[t * H + h] = core::FloatToBf16(static_cast<float>(ranks) *
                                                   core::Bf16ToFloat(in[me].hidden[t * H + h]));
    }
  }
  return want;
}

// Sets MOE_EP_ONESIDED_DIRECT_UNPACK for the dispatchers made in its scope.
class DirectUnpackEnv {
 public:
  explicit DirectUnpackEnv(bool direct) {
    EXPECT_EQ(setenv("MOE_EP_ONESIDED_DIRECT_UNPACK", direct ? "1" : "0", 1), 0);
  }
  ~DirectUnpackEnv() { unsetenv("MOE_EP_ONESIDED_DIRECT_UNPACK"); }
  DirectUnpackEnv(const DirectUnpackEnv&) = delete;
  DirectUnpackEnv& operator=(const DirectUnpackEnv&) = delete;
};

// Device memory a test writes and reads by copies: a DeviceBuffer's, or a
// region of the window (the receive buffers).
template <typename T>
void Fill(T* dst, const std::vector<T>& v) {
  EXPECT_EQ(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}
template <typename T>
std::vector<T> Read(const T* src, int64_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// Rank `rank`'s two dispatch + combine steps through a dispatcher on `w`:
// first R tokens per rank that all select an expert (every receive slot
// below each count filled), then `in`, into engine buffers of `rows` slots
// per source filled with 0x5a bytes before each step and counts of 777 —
// with `receive`, the window's receive buffers (c.receive_buffers, rows =
// N, the capacity). Returns the second step's buffers. `check`, when set,
// judges every step's CheckStep (else each must succeed). `capacity`: N
// (0: R).
EngineOut RunRank(const OsCase& c, const std::vector<MoeInputs>& in, int rank, int64_t r,
                  int64_t rows, bool direct, PeerWindows* w, const testing::Sync& sync,
                  bool receive = false,
                  const std::function<void(const absl::Status&)>& check = nullptr,
                  int64_t capacity = 0) {
  EngineOut got;
  auto d = OneSidedDispatcher::Create(w, testing::Options(c, capacity > 0 ? capacity : r), 0);
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return got;
  const OsReceiveBuffers rb = (*d)->receive_buffers();
  EXPECT_EQ(rb.hidden != nullptr, c.receive_buffers);
  if (receive) {
    EXPECT_EQ(rb.rows, rows);
  }
  const int64_t H = c.hidden;
  const int K = c.top_k;
  const int E = c.ep_size;
  const int L = LocalExperts(c);
  const int64_t tokens = c.tokens[rank];
  const MoeInputs first =
      testing::MakeInputs(c.seed + 1000 + rank, r, H, K, c.num_experts, 0.0, c.invalid_id);
  testing::DeviceBuffer<bf16_t> hidden(std::max(r, tokens) * H);
  testing::DeviceBuffer<int32_t> ids(std::max(r, tokens) * K);
  testing::DeviceBuffer<float> weights(std::max(r, tokens) * K);
  testing::DeviceBuffer<bf16_t> recv_hidden(E * rows * H);
  testing::DeviceBuffer<int32_t> recv_ids(E * rows * K);
  testing::DeviceBuffer<float> recv_weights(E * rows * K);
  testing::DeviceBuffer<int64_t> source_counts(E);
  testing::DeviceBuffer<int64_t> expert_counts(L);
  const int64_t out_rows = std::max<int64_t>(std::max(tokens, r), 1);
  testing::DeviceBuffer<bf16_t> combined(out_rows * H);
  OsZeroCounts zero;
  zero.ptr[0] = source_counts.get();
  zero.n[0] = E;
  zero.ptr[1] = expert_counts.get();
  zero.n[1] = L;
  UnpackReceivedParams u;
  u.recv = (*d)->received_rows();
  u.runtime_max = r;
  u.rows = rows;
  u.hidden_size = H;
  u.top_k = K;
  u.ep_size = E;
  u.first_expert = FirstExpert(c, rank);
  u.num_local_experts = L;
  u.invalid_expert_id = c.invalid_id;
  u.hidden = receive ? rb.hidden : recv_hidden.get();
  u.topk_ids = receive ? rb.topk_ids : recv_ids.get();
  u.topk_weights = receive ? rb.topk_weights : recv_weights.get();
  u.source_counts = source_counts.get();
  u.expert_counts = expert_counts.get();
  u.counts_zeroed = true;
  std::vector<int32_t> stale_ids(E * rows * K);
  std::memset(stale_ids.data(), 0x5a, stale_ids.size() * sizeof(int32_t));
  std::vector<float> stale_weights(E * rows * K);
  std::memset(stale_weights.data(), 0x5a, stale_weights.size() * sizeof(float));
  auto step = [&](int64_t epoch, const MoeInputs& x, int64_t t) {
    hidden.Upload(x.hidden);
    ids.Upload(x.ids);
    weights.Upload(x.weights);
    Fill(u.hidden, std::vector<bf16_t>(E * rows * H, 0x5a5a));
    Fill(u.topk_ids, stale_ids);
    Fill(u.topk_weights, stale_weights);
    source_counts.Upload(std::vector<int64_t>(E, 777));
    expert_counts.Upload(std::vector<int64_t>(L, 777));
    combined.Upload(std::vector<bf16_t>(out_rows * H, 0xffff));
    EXPECT_TRUE((*d)->CommitGeometry(epoch, r, t).ok());
    // Large R runs the route kernel apart: the unpack is its own kernel.
    EXPECT_EQ((*d)->UnpacksDirectly(u), direct && OsDispatchFused(r, E));
    sync();  // no rank uploads (device-wide) while a peer's kernel waits
    const absl::Status dispatched =
        (*d)->Dispatch(hidden.get(), ids.get(), weights.get(), t, zero, &u);
    EXPECT_TRUE(dispatched.ok()) << dispatched;
    // Whatever options.path says: the engine's slots are the SM path's.
    EXPECT_EQ((*d)->last_path(), OsPath::kSm);
    const absl::Status combined_status = (*d)->CombineFrom(u.hidden, rows, combined.get());
    EXPECT_TRUE(combined_status.ok()) << combined_status;
    const absl::Status checked = (*d)->CheckStep();
    if (check) {
      check(checked);
    } else {
      EXPECT_TRUE(checked.ok()) << checked;
    }
    EXPECT_EQ(cudaStreamSynchronize((*d)->stream()), cudaSuccess);
    sync();
  };
  step(1, first, r);
  step(2, in[rank], tokens);
  got.hidden = Read(u.hidden, E * rows * H);
  got.ids = Read(u.topk_ids, E * rows * K);
  got.weights = Read(u.topk_weights, E * rows * K);
  got.source_counts = source_counts.Download(E);
  got.expert_counts = expert_counts.Download(L);
  got.combined = combined.Download(tokens * H);
  return got;
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
  ASSERT_EQ(got.combined.size(), want.combined.size());
  for (size_t i = 0; i < want.combined.size(); ++i) {
    if (got.combined[i] == want.combined[i]) continue;
    ADD_FAILURE() << "combined output differs first at element " << i << ": got bf16 bits "
                  << got.combined[i] << ", want " << want.combined[i];
    break;
  }
}

// c.tokens: the second step's tokens per rank (<= r); rows >= r.
void RunDirectVsWindow(const OsCase& c, int64_t r, int64_t rows) {
  MOE_EP_REQUIRE_GPUS(1);
  std::vector<MoeInputs> in;
  in.reserve(c.ep_size);
  for (int s = 0; s < c.ep_size; ++s) in.push_back(MakeCase(c, s, c.tokens[s]));
  std::vector<EngineOut> want;
  want.reserve(c.ep_size);
  for (int me = 0; me < c.ep_size; ++me) {
    want.push_back(Reference(c, in, me, rows));
    // Some rows of the first step's count are stale in the second.
    ASSERT_LT(want.back().source_counts[me], r);
  }
  for (const bool direct : {true, false}) {
    const DirectUnpackEnv env(direct);
    std::vector<EngineOut> got(c.ep_size);
    testing::RunThreads(c, r, [&](int rank, PeerWindows* w, const testing::Sync& sync) {
      got[rank] = RunRank(c, in, rank, r, rows, direct, w, sync);
    });
    for (int me = 0; me < c.ep_size; ++me) {
      ExpectSame(got[me], want[me],
                 (direct ? "direct unpack, rank " : "window path, rank ") + std::to_string(me));
    }
  }
}

// Slots [0, keep) of each source's `rows` in `x` (the rest dropped).
EngineOut FirstSlots(const EngineOut& x, int E, int64_t rows, int64_t keep, int64_t H, int K) {
  EngineOut y = x;
  y.hidden.clear();
  y.ids.clear();
  y.weights.clear();
  for (int s = 0; s < E; ++s) {
    const int64_t at = s * rows;
    y.hidden.insert(y.hidden.end(), x.hidden.begin() + at * H, x.hidden.begin() + (at + keep) * H);
    y.ids.insert(y.ids.end(), x.ids.begin() + at * K, x.ids.begin() + (at + keep) * K);
    y.weights.insert(y.weights.end(), x.weights.begin() + at * K,
                     x.weights.begin() + (at + keep) * K);
  }
  return y;
}

// Into the window's receive buffers of N >= R rows a source: the peers
// store their rows in place at R <= 512, the unpack's copy otherwise; the
// reference's values in slots [0, R) (slots [R, N) are not written).
void RunReceiveBuffers(OsCase c, int64_t r, int64_t n) {
  MOE_EP_REQUIRE_GPUS(1);
  c.receive_buffers = true;
  std::vector<MoeInputs> in;
  in.reserve(c.ep_size);
  for (int s = 0; s < c.ep_size; ++s) in.push_back(MakeCase(c, s, c.tokens[s]));
  std::vector<EngineOut> got(c.ep_size);
  testing::RunThreads(c, n, [&](int rank, PeerWindows* w, const testing::Sync& sync) {
    got[rank] = RunRank(c, in, rank, r, n, true, w, sync, true, nullptr, n);
  });
  for (int me = 0; me < c.ep_size; ++me) {
    ExpectSame(FirstSlots(got[me], c.ep_size, n, r, c.hidden, c.top_k),
               FirstSlots(Reference(c, in, me, n), c.ep_size, n, r, c.hidden, c.top_k),
               "receive buffers, rank " + std::to_string(me));
  }
}

// The shape at EP 1: H 7168, top-8, 256 experts, 113 tokens at R
// 128 into 160 slots (padding below and above R).
TEST(OneSidedDirectUnpack, Ep1H7168Top8E256MatchesWindowPathAndReference) {
  RunDirectVsWindow({1, 7168, 8, 256, {113}, -1, 0.0}, 128, 160);
}
// Odd top-k (8-byte vectors on the send side), the invalid id num_experts
// (DESIGN §7's other convention), T == R == rows.
TEST(OneSidedDirectUnpack, Ep1OddTopKInvalidIdNumExpertsAllSlotsUsed) {
  RunDirectVsWindow({1, 2048, 3, 64, {64}, 64, 0.0}, 64, 64);
}
// EP 2: the own slab direct, the peer's through the window; uneven tokens.
TEST(OneSidedDirectUnpack, Ep2H7168Top8E256UnevenTokens) {
  RunDirectVsWindow({2, 7168, 8, 256, {113, 40}, -1, 0.0}, 128, 160);
}
// R at the copy-engine threshold (kAuto, ce_min_tokens 64 <= R 128): an
// engine's dispatch still packs each source's rows (the copy-engine path
// would leave tokens sent elsewhere in the slots below the counts).
TEST(OneSidedDirectUnpack, Ep2CopyEngineThresholdStillPacksRows) {
  OsCase c{2, 7168, 8, 256, {113, 40}, -1, 0.0};
  c.ce_min_tokens = 64;
  RunDirectVsWindow(c, 128, 160);
}
// The default threshold, R 4096 (the route kernel apart, the unpack its own
// kernel after the send kernel), H 2048, top-8, 64 experts.
TEST(OneSidedDirectUnpack, Ep2R4096DefaultThresholdUnfused) {
  RunDirectVsWindow({2, 2048, 8, 64, {4000, 2500}, -1, 0.0}, 4096, 4100);
}

// Issue 30's shape at EP 2 into the receive buffers: the peer's rows stored
// in place by its send kernel (peer_direct), uneven tokens, stale bytes.
TEST(OneSidedReceiveBuffers, Ep2H7168Top8E256PeersStoreInPlace) {
  RunReceiveBuffers({2, 7168, 8, 256, {113, 40}, -1, 0.0}, 128, 128);
}
// N 160 > R 128: the slab stride is N, not R (slots [R, N) not written).
TEST(OneSidedReceiveBuffers, Ep2CapacityAboveRStridesByN) {
  RunReceiveBuffers({2, 7168, 8, 256, {113, 40}, -1, 0.0}, 128, 160);
}
// Odd top-k and H 2048 at EP 4 (three peers' slabs), the invalid id
// num_experts.
TEST(OneSidedReceiveBuffers, Ep4OddTopKInvalidIdNumExperts) {
  RunReceiveBuffers({4, 2048, 3, 64, {64, 17, 0, 50}, 64, 0.0}, 64, 64);
}
// R 1024 (the route kernel apart): the receive buffers are the unpack's
// ordinary destination, same values.
TEST(OneSidedReceiveBuffers, Ep2R1024UnfusedUnpacksIntoThem) {
  RunReceiveBuffers({2, 2048, 8, 64, {1000, 700}, -1, 0.0}, 1024, 1024);
}
// Rank 0 dispatches into the receive buffers, rank 1 into its own: each
// step is refused on both ranks with a message naming the two choices,
// and the group keeps stepping (no deadline, no broken dispatcher).
TEST(OneSidedReceiveBuffers, Ep2RanksChoosingDifferentlyMismatch) {
  MOE_EP_REQUIRE_GPUS(1);
  OsCase c{2, 2048, 8, 64, {100, 90}, -1, 0.0};
  c.receive_buffers = true;
  const int64_t r = 128;
  std::vector<MoeInputs> in;
  in.reserve(c.ep_size);
  for (int s = 0; s < c.ep_size; ++s) in.push_back(MakeCase(c, s, c.tokens[s]));
  std::vector<std::vector<absl::Status>> seen(c.ep_size);
  testing::RunThreads(c, r, [&](int rank, PeerWindows* w, const testing::Sync& sync) {
    const EngineOut out = RunRank(c, in, rank, r, r, true, w, sync, rank == 0,
                                  [&](const absl::Status& s) { seen[rank].push_back(s); });
    EXPECT_EQ(out.source_counts, std::vector<int64_t>(c.ep_size, 0)) << "rank " << rank;
  });
  for (int rank = 0; rank < c.ep_size; ++rank) {
    ASSERT_EQ(seen[rank].size(), 2u) << "rank " << rank;
    for (const absl::Status& s : seen[rank]) {
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << "rank " << rank << ": " << s;
      EXPECT_NE(s.message().find("receive buffers mismatch"), std::string::npos) << s;
      EXPECT_NE(s.message().find(rank == 0 ? "rank 1 dispatched into its own buffers"
                                           : "rank 0 dispatched into the window's receive buffers"),
                std::string::npos)
          << s;
    }
  }
}

}  // namespace
}  // namespace moe_ep::kernels::onesided
