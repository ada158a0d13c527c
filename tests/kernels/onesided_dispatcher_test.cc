#include "kernels/onesided/onesided_dispatcher.h"

#include <gtest/gtest.h>

#include <barrier>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/gpu_ep_dispatcher.h"
#include "kernels/nccl_collective.h"
#include "kernels/onesided/nccl_peer_window.h"
#include "kernels/onesided/peer_window.h"
#include "tests/kernels/onesided_test_util.h"

// The one-sided data plane with ranks as threads sharing GPU 0 (provider
// ThreadWindowGroup): every dispatcher case against the CPU reference
// (core::ReferenceEpForward), agreement failures, a late peer, graphs; and at
// world 1, over thread windows and NCCL symmetric windows (provider
// CreateNcclPeerWindows), bit-exact against the NCCL plane
// (kernels::GpuEpDispatcher).

namespace moe_ep::kernels::onesided {
namespace onesided_dispatcher_test {
namespace {

using core::bf16_t;
using testing::OsCase;
using testing::Prepare;
using testing::Prepared;
using testing::RankBuffers;
using testing::RunCheckedStep;
using testing::RunThreads;
using testing::Sync;

std::unique_ptr<DeviceExpertSet> UploadExperts(const Prepared& p, int rank) {
  auto e = DeviceExpertSet::Upload(p.sets[rank]);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// Loads the expert kernels a case uses with one world-1 step, before ranks
// step together (see onesided_dispatcher.h on lazy loading).
void WarmUpExpertKernels(const OsCase& c) {
  OsCase one = c;
  one.ep_size = 1;
  one.tokens = {8};
  one.r = -1;
  const Prepared p = Prepare(one);
  RunThreads(one, 8, [&](int, PeerWindows* w, const Sync&) {
    auto d = OneSidedDispatcher::Create(w, testing::Options(one, 8), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    auto experts = UploadExperts(p, 0);
    RankBuffers b(p, 0, 8);
    RunCheckedStep(p, 0, **d, *experts, b, 1, false);
  });
}

void RunEager(const OsCase& c, bool phases = false) {
  MOE_EP_REQUIRE_GPUS(1);
  if (c.intermediate > 0) WarmUpExpertKernels(c);
  const Prepared p = Prepare(c);
  RunThreads(c, std::max<int64_t>(p.r, 1), [&](int rank, PeerWindows* w, const Sync& sync) {
    auto d = OneSidedDispatcher::Create(w, testing::Options(c, std::max<int64_t>(p.r, 1)), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    auto experts = UploadExperts(p, rank);
    ASSERT_NE(experts, nullptr);
    RankBuffers b(p, rank, c.tokens[rank]);
    // Three steps in a row: the windows and flags are reused step after step.
    for (int step = 0; step < 3; ++step) {
      sync();
      RunCheckedStep(p, rank, **d, *experts, b, 10 + step, phases);
    }
  });
}

// The kernels' blocks wait on each other, so a budget past the device's
// multiprocessors (which could not all be resident) is refused up front,
// naming the count; the device's own count is accepted and steps exactly
// with a grid of that many blocks (4096 rows of one 2 KB chunk each: 256
// warps' worth of blocks, cut to the budget).
TEST(OneSidedThreads, SmBudgetBoundByTheMultiprocessors) {
  MOE_EP_REQUIRE_GPUS(1);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const OsCase c{1, 1024, 4, 16, {20}};
  RunThreads(c, 32, [&](int, PeerWindows* w, const Sync&) {
    OneSidedDispatcherOptions o = testing::Options(c, 32);
    o.sm_budget = sms + 1;
    auto over = OneSidedDispatcher::Create(w, o, 0);
    ASSERT_FALSE(over.ok());
    EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(over.status().message().find(absl::StrFormat(
                  "sm_budget: expected <= the %d multiprocessors of CUDA device 0, got %d", sms,
                  sms + 1)),
              std::string::npos)
        << over.status();
  });
  OsCase all{1, 1024, 4, 16, {4096}};
  all.path = OsPathChoice::kSm;
  all.sm_budget = sms;
  RunEager(all);
}

TEST(OneSidedThreads, Ep2UnevenTokensFused) { RunEager({2, 2048, 8, 256, {37, 5}}); }
TEST(OneSidedThreads, Ep2UnevenTokensPhases) { RunEager({2, 2048, 8, 256, {37, 5}}, true); }
// R > 256: the separate route kernel, then the send kernel.
TEST(OneSidedThreads, Ep2UnfusedRouteR300) { RunEager({2, 1024, 4, 16, {300, 17}}); }
TEST(OneSidedThreads, Ep4ZeroTokenRankInvalidIds) {
  RunEager({4, 7168, 8, 256, {0, 9, 127, 1}, 256, 0.2});
}
TEST(OneSidedThreads, Ep4AllRanksEmpty) { RunEager({4, 512, 2, 8, {0, 0, 0, 0}}); }
// K odd: rows are 8 mod 16 bytes, so the 8-byte store path.
TEST(OneSidedThreads, Ep2OddTopK) { RunEager({2, 1024, 3, 12, {20, 31}}); }
TEST(OneSidedThreads, Ep2SwiGlu) { RunEager({2, 2048, 8, 64, {33, 20}, -1, 0.1, 64}); }

// fp8 e4m3 dispatch (issue 15 item 4): the send kernel quantizes into the
// peers' windows, Dispatch dequantizes the received rows; they equal the
// host contract's rows (core::DispatchedHidden) bit for bit.
OsCase Fp8(OsCase c) {
  c.dtype = core::DispatchDType::kFP8E4M3;
  return c;
}
TEST(OneSidedThreads, Fp8Ep2UnevenTokensFused) { RunEager(Fp8({2, 2048, 8, 256, {37, 5}})); }
TEST(OneSidedThreads, Fp8Ep2UnevenTokensPhases) { RunEager(Fp8({2, 2048, 8, 256, {37, 5}}), true); }
TEST(OneSidedThreads, Fp8Ep2UnfusedRouteR300) { RunEager(Fp8({2, 1024, 4, 16, {300, 17}})); }
TEST(OneSidedThreads, Fp8Ep4ZeroTokenRankSwiGlu) {
  RunEager(Fp8({4, 1024, 8, 64, {20, 0, 33, 7}, -1, 0.1, 64}));
}

// The copy-engine path (issue 15 item 3): the same cases against the
// reference, rows checked in its layout (ExpectReceivedCe).
OsCase Ce(OsCase c) {
  c.path = OsPathChoice::kCopyEngine;
  return c;
}
TEST(OneSidedThreadsCe, Ep1Tokens37) { RunEager(Ce({1, 2048, 8, 256, {37}})); }
TEST(OneSidedThreadsCe, Ep2UnevenTokens) { RunEager(Ce({2, 2048, 8, 256, {37, 5}})); }
TEST(OneSidedThreadsCe, Ep2UnevenTokensPhases) { RunEager(Ce({2, 2048, 8, 256, {37, 5}}), true); }
TEST(OneSidedThreadsCe, Ep2R300) { RunEager(Ce({2, 1024, 4, 16, {300, 17}})); }
TEST(OneSidedThreadsCe, Ep4ZeroTokenRankInvalidIds) {
  RunEager(Ce({4, 7168, 8, 256, {0, 9, 127, 1}, 256, 0.2}));
}
TEST(OneSidedThreadsCe, Ep4AllRanksEmpty) { RunEager(Ce({4, 512, 2, 8, {0, 0, 0, 0}})); }
TEST(OneSidedThreadsCe, Ep2OddTopK) { RunEager(Ce({2, 1024, 3, 12, {20, 31}})); }
TEST(OneSidedThreadsCe, Ep2SwiGlu) { RunEager(Ce({2, 2048, 8, 64, {33, 20}, -1, 0.1, 64})); }
TEST(OneSidedThreadsCe, Ep4SwiGluZeroTokenRank) {
  RunEager(Ce({4, 1024, 8, 64, {20, 0, 33, 7}, -1, 0.1, 64}));
}
// kAuto: R >= ce_min_tokens takes the copy engine (R 40 here), below it the
// SM path; last_path() reports it.
TEST(OneSidedThreadsCe, AutoPicksByR) {
  MOE_EP_REQUIRE_GPUS(1);
  for (const int64_t r : {39, 40}) {
    OsCase c{2, 1024, 8, 64, {r, 12}};
    c.ce_min_tokens = 40;
    const Prepared p = Prepare(c);
    RunThreads(c, 64, [&](int rank, PeerWindows* w, const Sync& sync) {
      auto d = OneSidedDispatcher::Create(w, testing::Options(c, 64), 0);
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ((*d)->PathFor(r), r >= 40 ? OsPath::kCopyEngine : OsPath::kSm);
      auto experts = UploadExperts(p, rank);
      RankBuffers b(p, rank, c.tokens[rank]);
      sync();
      RunCheckedStep(p, rank, **d, *experts, b, 3, false);
      EXPECT_EQ((*d)->last_path(), r >= 40 ? OsPath::kCopyEngine : OsPath::kSm) << "R " << r;
    });
  }
}

// Outputs of the two paths on the same inputs, bit for bit, per rank
// (identity experts: one bf16 rounding per partial on both).
void RunCeVsSm(const OsCase& base) {
  MOE_EP_REQUIRE_GPUS(1);
  std::vector<std::vector<std::vector<bf16_t>>> outs(2);  // [path][rank]
  for (int path = 0; path < 2; ++path) {
    OsCase c = base;
    c.path = path == 0 ? OsPathChoice::kSm : OsPathChoice::kCopyEngine;
    const Prepared p = Prepare(c);
    outs[path].resize(c.ep_size);
    RunThreads(c, p.r, [&](int rank, PeerWindows* w, const Sync& sync) {
      auto d = OneSidedDispatcher::Create(w, testing::Options(c, p.r), 0);
      ASSERT_TRUE(d.ok()) << d.status();
      auto experts = UploadExperts(p, rank);
      RankBuffers b(p, rank, c.tokens[rank]);
      sync();
      RunCheckedStep(p, rank, **d, *experts, b, 5, false);
      EXPECT_EQ((*d)->last_path(), path == 0 ? OsPath::kSm : OsPath::kCopyEngine);
      outs[path][rank] = b.out.Download(c.tokens[rank] * c.hidden);
    });
  }
  for (int rank = 0; rank < base.ep_size; ++rank) {
    EXPECT_EQ(outs[0][rank], outs[1][rank]) << "rank " << rank << ": ce output differs from sm";
  }
}
TEST(OneSidedThreadsCe, Ep2BitExactVsSm) { RunCeVsSm({2, 7168, 8, 256, {129, 40}, 256, 0.1}); }
TEST(OneSidedThreadsCe, Ep4BitExactVsSmZeroTokenRank) {
  RunCeVsSm({4, 2048, 8, 256, {70, 0, 513, 3}, -1, 0.1});
}

TEST(OneSidedCe, ChoosePath) {
  // The defaults: the SM path; auto from R 4096 (bench/results/onesided-ce).
  const OneSidedDispatcherOptions defaults;
  EXPECT_EQ(defaults.path, OsPathChoice::kSm);
  EXPECT_EQ(defaults.ce_min_tokens, 4096);
  EXPECT_EQ(ChooseOsPath(OsPathChoice::kAuto, 2047, 2048, false), OsPath::kSm);
  EXPECT_EQ(ChooseOsPath(OsPathChoice::kAuto, 2048, 2048, false), OsPath::kCopyEngine);
  EXPECT_EQ(ChooseOsPath(OsPathChoice::kAuto, 4096, 2048, true), OsPath::kSm);
  EXPECT_EQ(ChooseOsPath(OsPathChoice::kCopyEngine, 1, 2048, false), OsPath::kCopyEngine);
  EXPECT_EQ(ChooseOsPath(OsPathChoice::kSm, 4096, 2048, false), OsPath::kSm);
  EXPECT_EQ(*ParseOsPathChoice("ce"), OsPathChoice::kCopyEngine);
  EXPECT_EQ(*ParseOsPathChoice("auto"), OsPathChoice::kAuto);
  EXPECT_EQ(*ParseOsPathChoice("sm"), OsPathChoice::kSm);
  const absl::Status bad = ParseOsPathChoice("dma").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("auto, sm or ce"), std::string::npos) << bad;
  EXPECT_STREQ(OsPathName(OsPath::kCopyEngine), "ce");
  EXPECT_STREQ(OsPathName(OsPath::kSm), "sm");
}

// (epoch, R) disagreements ride in the flags: every rank's CheckStep reports
// kAborted naming the other, no output row is written, and the group goes on.
void RunMismatch(bool r_differs, OsPathChoice path = OsPathChoice::kAuto) {
  MOE_EP_REQUIRE_GPUS(1);
  OsCase c{2, 1024, 8, 64, {12, 7}};
  c.path = path;
  const Prepared p = Prepare(c);
  const int64_t capacity = 32;
  RunThreads(c, capacity, [&](int rank, PeerWindows* w, const Sync& sync) {
    auto d = OneSidedDispatcher::Create(w, testing::Options(c, capacity), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    auto experts = UploadExperts(p, rank);
    const int64_t t = c.tokens[rank];
    RankBuffers b(p, rank, t);
    b.PoisonOutput(t, c.hidden);
    sync();
    const int64_t epoch = (!r_differs && rank == 1) ? 6 : 5;
    const int64_t r = (r_differs && rank == 1) ? 24 : 16;
    ASSERT_TRUE((*d)->CommitGeometry(epoch, r, t).ok());
    ASSERT_TRUE(
        (*d)->Forward(b.hidden.get(), b.ids.get(), b.weights.get(), t, *experts, b.out.get()).ok());
    absl::Status s = (*d)->CheckStep();
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    const std::string other =
        absl::StrFormat("rank %d has (epoch %d, R %d)", 1 - rank, (!r_differs && rank == 0) ? 6 : 5,
                        (r_differs && rank == 0) ? 24 : 16);
    EXPECT_NE(s.message().find(other), std::string::npos) << s;
    for (bf16_t v : b.out.Download(t * c.hidden)) {
      ASSERT_EQ(v, 0xffff) << "rank " << rank << " wrote an output row after a mismatch";
    }
    // The next step, agreed, is correct.
    sync();
    RunCheckedStep(p, rank, **d, *experts, b, 7, false);
  });
}

TEST(OneSidedThreads, Ep2EpochMismatch) { RunMismatch(false); }
TEST(OneSidedThreads, Ep2RMismatch) { RunMismatch(true); }
TEST(OneSidedThreadsCe, Ep2EpochMismatch) { RunMismatch(false, OsPathChoice::kCopyEngine); }
TEST(OneSidedThreadsCe, Ep2RMismatch) { RunMismatch(true, OsPathChoice::kCopyEngine); }

// A rank whose caller's arguments failed its checks refuses the step
// (RefuseStep in place of its dispatch, or with `at_combine` RefuseCombine
// after a dispatch and expert compute like every rank's; issue 30 item 1):
// the peers' kernels finish at once instead of waiting out the timeout (5 s
// here: a wait would end kDeadlineExceeded), their CheckStep is kAborted
// naming the refusing rank and the refused phase, no rank wrote an output
// row, the refusing rank's CheckStep reports nothing, the step is over on
// every rank (another Combine is a sequence error), and the next step is
// correct on every rank. `also` (>= 0): a second refusing rank, whose own
// CheckStep reports nothing either (both refusals are their callers').
void RunRefusal(int ep_size, int refusing, OsPathChoice path, bool at_combine = false,
                int also = -1) {
  MOE_EP_REQUIRE_GPUS(1);
  OsCase c{ep_size, 1024, 8, 64, {}};
  for (int r = 0; r < ep_size; ++r) c.tokens.push_back(5 + 7 * r);
  c.path = path;
  const Prepared p = Prepare(c);
  const int64_t capacity = 32;
  RunThreads(c, capacity, [&](int rank, PeerWindows* w, const Sync& sync) {
    auto d = OneSidedDispatcher::Create(w, testing::Options(c, capacity, absl::Seconds(5)), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    auto experts = UploadExperts(p, rank);
    const int64_t t = c.tokens[rank];
    RankBuffers b(p, rank, t);
    b.PoisonOutput(t, c.hidden);
    sync();
    ASSERT_TRUE((*d)->CommitGeometry(5, p.r, t).ok());
    const absl::Time start = absl::Now();
    const bool refuses = rank == refusing || rank == also;
    if (refuses && !at_combine) {
      ASSERT_TRUE((*d)->RefuseStep().ok());
    } else {
      ASSERT_TRUE((*d)->Dispatch(b.hidden.get(), b.ids.get(), b.weights.get(), t).ok());
      ASSERT_TRUE((*d)->ComputeExperts(*experts).ok());
      if (refuses) {
        ASSERT_TRUE((*d)->RefuseCombine().ok());
      } else {
        ASSERT_TRUE((*d)->Combine(b.out.get()).ok());
      }
    }
    const absl::Status s = (*d)->CheckStep();
    EXPECT_LT(absl::Now() - start, absl::Seconds(4))
        << "rank " << rank << " waited for the refusal";
    if (refuses) {
      EXPECT_TRUE(s.ok()) << s;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      const char* phase = at_combine ? "combine" : "dispatch";
      // With two refusing ranks either may be the one recorded first.
      const bool named = [&] {
        for (int r : {refusing, also}) {
          if (r >= 0 &&
              s.message().find(absl::StrFormat("rank %d refused its %s of the step at epoch 5", r,
                                               phase)) != std::string::npos) {
            return true;
          }
        }
        return false;
      }();
      EXPECT_TRUE(named) << s;
    }
    for (bf16_t v : b.out.Download(t * c.hidden)) {
      ASSERT_EQ(v, 0xffff) << "rank " << rank << " wrote an output row of a refused step";
    }
    EXPECT_EQ((*d)->Combine(b.out.get()).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*d)->RefuseCombine().code(), absl::StatusCode::kFailedPrecondition);
    sync();
    RunCheckedStep(p, rank, **d, *experts, b, 7, false);
  });
}
TEST(OneSidedThreads, Ep2RefusedStepEndsAtOnce) { RunRefusal(2, 1, OsPathChoice::kAuto); }
TEST(OneSidedThreads, Ep4RefusedStepEndsAtOnce) { RunRefusal(4, 2, OsPathChoice::kAuto); }
TEST(OneSidedThreadsCe, Ep2RefusedStepEndsAtOnce) { RunRefusal(2, 0, OsPathChoice::kCopyEngine); }
TEST(OneSidedThreads, Ep2RefusedCombineEndsAtOnce) {
  RunRefusal(2, 1, OsPathChoice::kAuto, /*at_combine=*/true);
}
TEST(OneSidedThreads, Ep4RefusedCombineEndsAtOnce) {
  RunRefusal(4, 0, OsPathChoice::kAuto, /*at_combine=*/true);
}
TEST(OneSidedThreads, Ep4TwoRefusedStepsEndAtOnce) {
  RunRefusal(4, 1, OsPathChoice::kAuto, /*at_combine=*/false, /*also=*/3);
}
TEST(OneSidedThreads, Ep4TwoRefusedCombinesEndAtOnce) {
  RunRefusal(4, 1, OsPathChoice::kAuto, /*at_combine=*/true, /*also=*/3);
}
TEST(OneSidedThreadsCe, Ep2RefusedCombineEndsAtOnce) {
  RunRefusal(2, 0, OsPathChoice::kCopyEngine, /*at_combine=*/true);
}

// A peer that never publishes its flag: the waiting rank's step ends by the
// timeout, CheckStep says DEADLINE_EXCEEDED naming it, and the dispatcher is
// broken afterwards.
void RunLatePeer(OsPathChoice path) {
  MOE_EP_REQUIRE_GPUS(1);
  OsCase c{2, 1024, 8, 64, {12, 7}};
  c.path = path;
  const Prepared p = Prepare(c);
  RunThreads(c, 16, [&](int rank, PeerWindows* w, const Sync& sync) {
    auto d = OneSidedDispatcher::Create(w, testing::Options(c, 16, absl::Milliseconds(200)), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    auto experts = UploadExperts(p, rank);
    const int64_t t = c.tokens[rank];
    RankBuffers b(p, rank, t);
    b.PoisonOutput(t, c.hidden);
    sync();
    if (rank == 1) return;  // the late peer: takes no part in the step
    ASSERT_TRUE((*d)->CommitGeometry(1, 16, t).ok());
    ASSERT_TRUE(
        (*d)->Forward(b.hidden.get(), b.ids.get(), b.weights.get(), t, *experts, b.out.get()).ok());
    absl::Status s = (*d)->CheckStep();
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("rank 0 waited 200ms for rank 1's flag"), std::string::npos) << s;
    EXPECT_NE(s.message().find("dispatch"), std::string::npos) << s;
    for (bf16_t v : b.out.Download(t * c.hidden)) ASSERT_EQ(v, 0xffff);
    absl::Status next = (*d)->CommitGeometry(2, 16, t);
    EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition) << next;
  });
}
TEST(OneSidedThreads, Ep2LatePeerDeadlineExceeded) { RunLatePeer(OsPathChoice::kAuto); }
TEST(OneSidedThreadsCe, Ep2LatePeerDeadlineExceeded) { RunLatePeer(OsPathChoice::kCopyEngine); }

// A graph captured at bucket 64 replays below it with other T per rank
// (fresh inputs in the captured buffers), against the reference at R = 64.
void RunGraph(int ep_size, core::DispatchDType dtype = core::DispatchDType::kBF16,
              OsPathChoice path = OsPathChoice::kAuto) {
  MOE_EP_REQUIRE_GPUS(1);
  const int64_t bucket = 64;
  const std::vector<std::vector<int64_t>> rounds = {{64, 3, 0, 17}, {9, 64, 33, 0}, {0, 0, 1, 64}};
  std::vector<Prepared> preps;
  for (size_t i = 0; i < rounds.size(); ++i) {
    OsCase c{ep_size, 2048, 8, 256, {}, -1, 0.1, 0, bucket, 500 + i, dtype};
    c.tokens.assign(rounds[i].begin(), rounds[i].begin() + ep_size);
    c.path = path;
    preps.push_back(Prepare(c));
  }
  RunThreads(preps[0].c, bucket, [&](int rank, PeerWindows* w, const Sync& sync) {
    auto d = OneSidedDispatcher::Create(w, testing::Options(preps[0].c, bucket), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    auto experts = UploadExperts(preps[0], rank);
    RankBuffers b(preps[0], rank, bucket);
    ASSERT_TRUE((*d)->CommitGeometry(1, bucket, bucket).ok());
    absl::Status s = (*d)->CaptureForward(bucket, b.hidden.get(), b.ids.get(), b.weights.get(),
                                          *experts, b.out.get());
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ((*d)->last_path(),
              path == OsPathChoice::kCopyEngine ? OsPath::kCopyEngine : OsPath::kSm);
    for (size_t i = 0; i < preps.size(); ++i) {
      const Prepared& p = preps[i];
      const int64_t t = p.c.tokens[rank];
      sync();
      b.Load(p, rank);
      b.PoisonOutput(bucket, p.c.hidden);
      s = (*d)->ReplayForward(bucket, 40 + i, t);
      ASSERT_TRUE(s.ok()) << s;
      s = (*d)->CheckStep();
      ASSERT_TRUE(s.ok()) << "rank " << rank << " round " << i << ": " << s;
      testing::ExpectReceived(p, rank, **d);
      const std::vector<bf16_t> all = b.out.Download(bucket * p.c.hidden);
      testing::ExpectOutput(p, rank,
                            std::vector<bf16_t>(all.begin(), all.begin() + t * p.c.hidden));
      for (size_t j = t * p.c.hidden; j < all.size(); ++j) {
        ASSERT_EQ(all[j], 0xffff) << "row " << j / p.c.hidden << " beyond T written";
      }
    }
    EXPECT_EQ((*d)->ReplayForward(32, 1, 1).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*d)->ReplayForward(bucket, 1, bucket + 1).code(),
              absl::StatusCode::kInvalidArgument);
  });
}

TEST(OneSidedThreads, Ep2GraphBucketReplayBelow) { RunGraph(2); }
TEST(OneSidedThreads, Ep4GraphBucketReplayBelow) { RunGraph(4); }
TEST(OneSidedThreads, Fp8Ep2GraphBucketReplayBelow) { RunGraph(2, core::DispatchDType::kFP8E4M3); }
TEST(OneSidedThreadsCe, Ep2GraphBucketReplayBelow) {
  RunGraph(2, core::DispatchDType::kBF16, OsPathChoice::kCopyEngine);
}
TEST(OneSidedThreadsCe, Ep4GraphBucketReplayBelow) {
  RunGraph(4, core::DispatchDType::kBF16, OsPathChoice::kCopyEngine);
}

TEST(OneSidedThreads, CreateRejectsBadOptions) {
  MOE_EP_REQUIRE_GPUS(1);
  const OsCase c{1, 1020, 8, 64, {4}};  // H % 8 != 0
  EXPECT_EQ(OneSidedDispatcher::WindowBytes(testing::EpOptions(c, 8)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const OsCase ok{1, 1024, 8, 64, {4}};
  RunThreads(ok, 8, [&](int, PeerWindows* w, const Sync&) {
    auto wrong = OneSidedDispatcher::Create(w, testing::Options(ok, 16), 0);  // other N
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument) << wrong.status();
    auto capped = OneSidedDispatcher::Create(w, testing::Options(ok, 8), 1024);
    EXPECT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted) << capped.status();
    OneSidedDispatcherOptions zero = testing::Options(ok, 8);
    zero.ce_min_tokens = 0;
    auto bad_threshold = OneSidedDispatcher::Create(w, zero, 0);
    EXPECT_EQ(bad_threshold.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad_threshold.status().message().find("ce_min_tokens"), std::string::npos);
  });
  // fp8 rows are quantized by the send kernel: path ce is refused, auto
  // falls back to the SM path at any R.
  OsCase fp8{1, 1024, 8, 64, {4}};
  fp8.dtype = core::DispatchDType::kFP8E4M3;
  RunThreads(fp8, 8, [&](int, PeerWindows* w, const Sync&) {
    OneSidedDispatcherOptions o = testing::Options(fp8, 8);
    o.path = OsPathChoice::kCopyEngine;
    auto refused = OneSidedDispatcher::Create(w, o, 0);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find("bf16 rows only"), std::string::npos);
    o.path = OsPathChoice::kAuto;
    o.ce_min_tokens = 1;
    auto d = OneSidedDispatcher::Create(w, o, 0);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ((*d)->PathFor(8), OsPath::kSm);
  });
}

// World 1: the one-sided plane (over thread windows and over NCCL symmetric
// windows) and the NCCL plane on the same inputs give the same output bits
// (identity experts), eager and graph-replayed.
void ExpectSameAsNccl(const Prepared& p, const DeviceExpertSet& experts, PeerWindows* w,
                      const std::vector<bf16_t>& want, OsPathChoice path) {
  OsCase c = p.c;
  c.path = path;
  const int64_t t = c.tokens[0];
  SCOPED_TRACE(path == OsPathChoice::kCopyEngine ? "path ce" : "path sm");
  auto d = OneSidedDispatcher::Create(w, testing::Options(c, t), 0);
  ASSERT_TRUE(d.ok()) << d.status();
  RankBuffers b(p, 0, t);
  ASSERT_TRUE((*d)->CommitGeometry(1, t, t).ok());
  ASSERT_TRUE(
      (*d)->Forward(b.hidden.get(), b.ids.get(), b.weights.get(), t, experts, b.out.get()).ok());
  ASSERT_TRUE((*d)->CheckStep().ok());
  EXPECT_EQ(b.out.Download(t * c.hidden), want)
      << w->provider() << ": eager output differs from the NCCL plane";
  b.PoisonOutput(t, c.hidden);
  ASSERT_TRUE(
      (*d)->CaptureForward(t, b.hidden.get(), b.ids.get(), b.weights.get(), experts, b.out.get())
          .ok());
  ASSERT_TRUE((*d)->ReplayForward(t, 2, t).ok());
  ASSERT_TRUE((*d)->CheckStep().ok());
  EXPECT_EQ(b.out.Download(t * c.hidden), want)
      << w->provider() << ": replayed output differs from the NCCL plane";
}

void RunBitExact(const OsCase& c) {
  MOE_EP_REQUIRE_GPUS(1);
  const Prepared p = Prepare(c);
  const int64_t t = c.tokens[0];
  auto experts = UploadExperts(p, 0);
  RankBuffers nccl_b(p, 0, t);
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto coll = NcclCollective::Create(*id, 0, 1, 0, std::chrono::seconds(60));
  ASSERT_TRUE(coll.ok()) << coll.status();
  {
    GpuEpDispatcherOptions o;
    o.dispatcher = testing::EpOptions(c, t);
    auto disp = GpuEpDispatcher::Create(coll->get(), o, 0);
    ASSERT_TRUE(disp.ok()) << disp.status();
    ASSERT_TRUE((*disp)->CommitGeometry(1, t, t).ok());
    ASSERT_TRUE((*disp)
                    ->Forward(nccl_b.hidden.get(), nccl_b.ids.get(), nccl_b.weights.get(), t,
                              *experts, nccl_b.out.get())
                    .ok());
    ASSERT_TRUE((*disp)->CheckStep().ok());
  }
  const std::vector<bf16_t> want = nccl_b.out.Download(t * c.hidden);
  // fp8 rows move on the SM path only (the send kernel quantizes).
  const bool bf16 = c.dtype == core::DispatchDType::kBF16;
  for (const OsPathChoice path : {OsPathChoice::kSm, OsPathChoice::kCopyEngine}) {
    if (!bf16 && path == OsPathChoice::kCopyEngine) continue;
    RunThreads(c, t, [&](int, PeerWindows* w, const Sync&) {
      ExpectSameAsNccl(p, *experts, w, want, path);
    });
  }
  auto bytes = OneSidedDispatcher::WindowBytes(testing::EpOptions(c, t));
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto nccl_windows = CreateNcclPeerWindows(coll->get(), *bytes);
  ASSERT_TRUE(nccl_windows.ok()) << nccl_windows.status();
  EXPECT_STREQ((*nccl_windows)->provider(), "nccl-lsa");
  ExpectSameAsNccl(p, *experts, nccl_windows->get(), want, OsPathChoice::kSm);
  if (bf16) ExpectSameAsNccl(p, *experts, nccl_windows->get(), want, OsPathChoice::kCopyEngine);
}

TEST(OneSidedWorld1, BitExactVsNcclH7168Top8E256Tokens128) {
  RunBitExact({1, 7168, 8, 256, {128}, 256, 0.1});
}
TEST(OneSidedWorld1, BitExactVsNcclUnfusedTokens1000) {
  RunBitExact({1, 2048, 8, 256, {1000}, -1, 0.05});
}
// Both planes dequantize the same e4m3 rows: fp8 outputs agree bit for bit.
TEST(OneSidedWorld1, Fp8BitExactVsNcclH7168Top8E256Tokens128) {
  OsCase c{1, 7168, 8, 256, {128}, 256, 0.1};
  c.dtype = core::DispatchDType::kFP8E4M3;
  RunBitExact(c);
}

}  // namespace
}  // namespace onesided_dispatcher_test
}  // namespace moe_ep::kernels::onesided
