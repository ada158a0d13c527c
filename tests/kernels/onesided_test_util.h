#pragma once

// Shared pieces of the one-sided data-plane tests (ranks as threads and as
// CUDA IPC processes): seeded cases, the CPU reference, one checked step.
// Test-only.

#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/expert_placement.h"
#include "core/moe_reference.h"
#include "kernels/device_experts.h"
#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/onesided/peer_window.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels::onesided::testing {

using core::bf16_t;
using kernels::testing::DeviceBuffer;
using kernels::testing::MakeInputs;
using kernels::testing::MoeInputs;

struct OsCase {
  int ep_size = 2;
  int64_t hidden = 1024;
  int top_k = 8;
  int num_experts = 64;
  std::vector<int64_t> tokens;  // per rank
  int32_t invalid_id = -1;
  double invalid_fraction = 0.1;
  int64_t intermediate = 0;  // > 0: SwiGLU experts
  int64_t r = -1;            // R; < 0: max of tokens
  uint64_t seed = 77;
  // fp8_e4m3: the reference applies the same rounding (issue 15 item 4).
  core::DispatchDType dtype = core::DispatchDType::kBF16;
  // The data plane's path (issue 15 item 3) and the auto threshold.
  OsPathChoice path = OsPathChoice::kAuto;
  int64_t ce_min_tokens = OneSidedDispatcherOptions::kDefaultCeMinTokens;
  int sm_budget = 8;             // blocks of each communication kernel
  bool receive_buffers = false;  // windows with receive buffers (OsWindowLayout)
};

// Inputs, experts and the CPU reference of one case.
struct Prepared {
  OsCase c;
  std::vector<core::ExpertSet> sets;
  std::vector<MoeInputs> inputs;
  core::EpReferenceResult ref;
  int64_t r = 0;
};

inline Prepared Prepare(const OsCase& c) {
  Prepared p;
  p.c = c;
  auto placement = core::ExpertPlacement::Contiguous(c.num_experts, c.ep_size);
  EXPECT_TRUE(placement.ok()) << placement.status();
  for (int r = 0; r < c.ep_size; ++r) {
    if (c.intermediate > 0) {
      auto s =
          core::ExpertSet::GenerateSwiGlu(1234, 3, placement->FirstExpert(r),
                                          placement->NumLocalExperts(r), c.hidden, c.intermediate);
      EXPECT_TRUE(s.ok()) << s.status();
      p.sets.push_back(std::move(*s));
    } else {
      p.sets.push_back(core::ExpertSet::Identity(placement->FirstExpert(r),
                                                 placement->NumLocalExperts(r), c.hidden));
    }
    p.inputs.push_back(MakeInputs(c.seed + r, c.tokens[r], c.hidden, c.top_k, c.num_experts,
                                  c.invalid_fraction, c.invalid_id));
  }
  std::vector<core::EpRankInput> in;
  std::vector<const core::ExpertSet*> sets;
  for (int r = 0; r < c.ep_size; ++r) {
    in.push_back({p.inputs[r].hidden, p.inputs[r].ids, p.inputs[r].weights, c.tokens[r]});
    sets.push_back(&p.sets[r]);
  }
  core::EpReferenceOptions o;
  o.invalid_expert_id = c.invalid_id;
  o.runtime_max_tokens_per_rank = c.r;
  o.dispatch_dtype = c.dtype;
  auto ref = core::ReferenceEpForward(*placement, sets, in, c.top_k, o);
  EXPECT_TRUE(ref.ok()) << ref.status();
  p.ref = std::move(*ref);
  p.r = p.ref.runtime_max_tokens_per_rank;
  return p;
}

inline core::EpDispatcherOptions EpOptions(const OsCase& c, int64_t capacity) {
  core::EpDispatcherOptions o;
  o.workspace = {c.ep_size, capacity, c.hidden, c.top_k, c.dtype};
  o.num_experts = c.num_experts;
  o.invalid_expert_id = c.invalid_id;
  return o;
}

inline OneSidedDispatcherOptions Options(const OsCase& c, int64_t capacity,
                                         absl::Duration timeout = absl::Seconds(20)) {
  OneSidedDispatcherOptions o;
  o.dispatcher = EpOptions(c, capacity);
  o.max_intermediate = c.intermediate;
  o.sm_budget = c.sm_budget;
  o.timeout = timeout;
  o.path = c.path;
  o.ce_min_tokens = c.ce_min_tokens;
  o.receive_buffers = c.receive_buffers;
  return o;
}

// The tolerance of tests/kernels/gpu_ep_dispatcher_test.cc, per element:
// |got - want| <= |want| / 64 + rms / 64 + partial / 128, partial = sum over
// destination ranks of |that rank's bf16 partial| (each partial is rounded to
// bf16 on both sides; SwiGLU adds GEMM order and its bf16 activation).
// Identity experts differ by at most one bf16 ulp of a partial. Bit-exactness
// is checked against the NCCL plane instead (World1BitExactVsNccl).
inline void ExpectOutput(const Prepared& p, int rank, const std::vector<bf16_t>& got) {
  const std::vector<bf16_t>& want = p.ref.output[rank];
  ASSERT_EQ(got.size(), want.size()) << "rank " << rank;
  const int64_t h = p.c.hidden;
  const int64_t r = p.r;
  std::vector<float> partial(want.size(), 0.0f);
  for (const core::EpRankReceive& rx : p.ref.received) {
    for (int64_t slot = 0; slot < r; ++slot) {
      const int64_t t = rx.source_token[rank * r + slot];
      if (t < 0) continue;
      for (int64_t i = 0; i < h; ++i) {
        partial[t * h + i] += std::abs(core::Bf16ToFloat(rx.expert_out[(rank * r + slot) * h + i]));
      }
    }
  }
  double sq = 0;
  for (bf16_t w : want) sq += double(core::Bf16ToFloat(w)) * core::Bf16ToFloat(w);
  const double rms = want.empty() ? 0 : std::sqrt(sq / want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = core::Bf16ToFloat(got[i]);
    const double w = core::Bf16ToFloat(want[i]);
    if (!(std::abs(g - w) <= std::abs(w) / 64 + rms / 64 + partial[i] / 128)) {
      if (++bad <= 5)
        ADD_FAILURE() << "rank " << rank << " element " << i << ": " << g << " vs " << w;
    }
  }
  EXPECT_EQ(bad, 0) << "rank " << rank;
}

// The copy-engine layout (onesided_kernels.cuh): source s's token t sits at
// slot t of slab s, count = T_s; each reference row (slot j holding token t)
// is found at slot t bit for bit, with its ids and weights; slots >= T_s
// carry the invalid id and zero weights.
inline void ExpectReceivedCe(const Prepared& p, int rank, const ReceivedRowsForTest& got,
                             const std::vector<int32_t>& counts) {
  const core::EpRankReceive& want = p.ref.received[rank];
  const int64_t h = p.c.hidden;
  const int k = p.c.top_k;
  const int64_t r = p.r;
  for (int s = 0; s < p.c.ep_size; ++s) {
    EXPECT_EQ(counts[s], p.c.tokens[s]) << "rank " << rank << " from " << s;
    for (int64_t slot = 0; slot < want.counts[s]; ++slot) {
      const int64_t t = want.source_token[s * r + slot];
      ASSERT_GE(t, 0);
      const int64_t w = s * r + slot;
      const int64_t g = s * r + t;
      ASSERT_TRUE(std::equal(want.hidden.begin() + w * h, want.hidden.begin() + (w + 1) * h,
                             got.hidden.begin() + g * h))
          << "rank " << rank << " source " << s << " token " << t;
      for (int i = 0; i < k; ++i) {
        ASSERT_EQ(got.ids[g * k + i], want.ids[w * k + i]) << "source " << s << " token " << t;
        ASSERT_EQ(got.weights[g * k + i], want.weights[w * k + i]);
      }
    }
    for (int64_t slot = p.c.tokens[s]; slot < r; ++slot) {
      for (int i = 0; i < k; ++i) {
        ASSERT_EQ(got.ids[(s * r + slot) * k + i], p.c.invalid_id) << "padding slot " << slot;
        ASSERT_EQ(got.weights[(s * r + slot) * k + i], 0.0f);
      }
    }
  }
}

// Received rows of `rank` vs the reference: counts, ids, weights exactly,
// hidden bit-exact on valid slots (the SM path's compacted layout; the
// copy-engine path's by ExpectReceivedCe).
inline void ExpectReceived(const Prepared& p, int rank, OneSidedDispatcher& d) {
  auto got = d.CopyReceivedForTest();
  ASSERT_TRUE(got.ok()) << got.status();
  auto counts = d.ReceivedCountsForTest();
  ASSERT_TRUE(counts.ok()) << counts.status();
  if (d.last_path() == OsPath::kCopyEngine) {
    ExpectReceivedCe(p, rank, *got, *counts);
    return;
  }
  const core::EpRankReceive& want = p.ref.received[rank];
  for (int s = 0; s < p.c.ep_size; ++s) {
    EXPECT_EQ((*counts)[s], want.counts[s]) << "rank " << rank << " from " << s;
  }
  EXPECT_EQ(got->ids, want.ids) << "rank " << rank;
  EXPECT_EQ(got->weights, want.weights) << "rank " << rank;
  const int64_t h = p.c.hidden;
  for (int s = 0; s < p.c.ep_size; ++s) {
    for (int64_t slot = 0; slot < want.counts[s]; ++slot) {
      const int64_t row = s * p.r + slot;
      ASSERT_TRUE(std::equal(want.hidden.begin() + row * h, want.hidden.begin() + (row + 1) * h,
                             got->hidden.begin() + row * h))
          << "rank " << rank << " source " << s << " slot " << slot;
    }
  }
}

// Device copies of one rank's inputs with room for `rows` tokens.
struct RankBuffers {
  RankBuffers(const Prepared& p, int rank, int64_t rows)
      : hidden(rows * p.c.hidden),
        ids(rows * p.c.top_k),
        weights(rows * p.c.top_k),
        out(std::max<int64_t>(rows, 1) * p.c.hidden) {
    Load(p, rank);
  }
  void Load(const Prepared& p, int rank) {
    hidden.Upload(p.inputs[rank].hidden);
    ids.Upload(p.inputs[rank].ids);
    weights.Upload(p.inputs[rank].weights);
  }
  // Fills the output with 0xffff (a NaN), so a row the step did not write shows.
  void PoisonOutput(int64_t rows, int64_t h) {
    out.Upload(std::vector<bf16_t>(std::max<int64_t>(rows, 1) * h, 0xffff));
  }
  DeviceBuffer<bf16_t> hidden;
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> weights;
  DeviceBuffer<bf16_t> out;
};

// One eager step of `rank` (Forward, or the three phases) on buffers `b`
// (loaded with this rank's inputs), checked against the reference: received
// rows and output. Allocates nothing: with ranks as threads, an allocation or
// free (device-wide sync) while a peer's kernel waits for this rank would
// stall both until the timeout.
inline void RunCheckedStep(const Prepared& p, int rank, OneSidedDispatcher& d,
                           const DeviceExpertSet& experts, RankBuffers& b, int64_t epoch,
                           bool phases) {
  const int64_t t = p.c.tokens[rank];
  ASSERT_TRUE(d.CommitGeometry(epoch, p.r, t).ok());
  if (phases) {
    absl::Status s = d.Dispatch(b.hidden.get(), b.ids.get(), b.weights.get(), t);
    ASSERT_TRUE(s.ok()) << s;
    s = d.ComputeExperts(experts);
    ASSERT_TRUE(s.ok()) << s;
    s = d.Combine(b.out.get());
    ASSERT_TRUE(s.ok()) << s;
  } else {
    absl::Status s =
        d.Forward(b.hidden.get(), b.ids.get(), b.weights.get(), t, experts, b.out.get());
    ASSERT_TRUE(s.ok()) << s;
  }
  absl::Status s = d.CheckStep();
  ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s;
  ExpectReceived(p, rank, d);
  ExpectOutput(p, rank, b.out.Download(t * p.c.hidden));
}

// Runs body(rank, windows, sync) on ep_size threads sharing GPU 0, each
// having joined one ThreadWindowGroup with windows for `capacity` tokens.
// sync() is a barrier of the rank threads: bodies call it before each step,
// so no rank allocates, frees or copies (device-wide syncs) while a peer's
// kernel waits for it. A thread that ends (or fails) leaves the barrier.
using Sync = std::function<void()>;
inline void RunThreads(const OsCase& c, int64_t capacity,
                       const std::function<void(int, PeerWindows*, const Sync&)>& body) {
  auto bytes = OneSidedDispatcher::WindowBytes(testing::EpOptions(c, capacity), c.receive_buffers);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto group = ThreadWindowGroup::Create(c.ep_size);
  ASSERT_TRUE(group.ok()) << group.status();
  std::barrier<> bar(c.ep_size);
  const Sync sync = [&bar] { bar.arrive_and_wait(); };
  std::vector<std::thread> threads;
  threads.reserve(c.ep_size);
  for (int r = 0; r < c.ep_size; ++r) {
    threads.emplace_back([&, r] {
      [&] {
        ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
        auto windows = (*group)->Join(r, 0, *bytes, absl::Seconds(60));
        ASSERT_TRUE(windows.ok()) << windows.status();
        body(r, windows->get(), sync);
      }();
      bar.arrive_and_drop();
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace moe_ep::kernels::onesided::testing
