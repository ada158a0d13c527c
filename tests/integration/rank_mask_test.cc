// Rank masks end to end (DESIGN §15; issue 17 item 3): 4 real Gloo workers on
// loopback with 2 redundant slots a rank run a series of Forward steps; rank
// 0 (whose store formed the group) or rank 2 is killed with SIGKILL while a
// step is in flight. The survivors agree on a mask without a new generation
// (the lowest live rank hosts the round's store) and keep serving: every
// step after the mask equals the CPU reference under the same mask
// (core::PlacementTable::WithMask), bit for bit; the expert whose only
// replica was on the killed rank is reported per step by id and contributes
// zero; GetStatus shows the mask and the group is not broken. The time from
// the kill to the first correct masked step is printed (recorded in
// bench/results/masks/README.md); the test asserts values, not times.

#include <algorithm>
#include <iostream>
#include <set>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/rank_mask_fixture.h"

namespace moe_ep::testing {
namespace {

using ::testing::ElementsAre;

TEST_P(RankMaskTest, SurvivorsMaskTheKilledRankAndMatchTheMaskedReference) {
  const int victim = GetParam();
  const int lost_expert = victim == 0 ? 0 : 9;  // its only replica was on the victim
  std::vector<int> all = {0, 1, 2, 3};
  std::vector<int> survivors;
  std::vector<bool> live(kWorld, true);
  for (int r = 0; r < kWorld; ++r) {
    if (r != victim) survivors.push_back(r);
  }
  live[victim] = false;
  const std::vector<bool> everyone(kWorld, true);

  std::vector<v1::ForwardResponse> got;
  for (int step = 0; step < kKillAtStep; ++step) {
    const std::vector<absl::Status> status = Step(step, all, &got);
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
    ExpectEqualsReference(step, all, everyone, got);
  }

  // The kill lands while step kKillAtStep runs (its calls are in flight).
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(2));
    EXPECT_TRUE(fake_->cluster().Kill(victim, SIGKILL).ok());
  });
  const absl::Time killed = absl::Now();
  std::vector<absl::Status> status = Step(kKillAtStep, all, &got);
  killer.join();
  // Whatever this step gave (it may have completed before the kill), the
  // client sends it again to the live ranks until every survivor answers:
  // the survivors mask the killed rank meanwhile.
  (void)status;
  int attempts = 1;
  std::vector<v1::ForwardResponse> masked_got;
  int first_masked_step = kKillAtStep;
  while (true) {
    status = Step(first_masked_step, survivors, &masked_got);
    ++attempts;
    bool all_ok = true;
    for (size_t i = 0; i < survivors.size(); ++i) {
      all_ok = all_ok && status[i].ok();
    }
    if (all_ok) break;
    ASSERT_LT(attempts, 6) << "survivors did not mask the killed rank: rank " << survivors[0]
                           << ": " << status[0];
  }
  // OnRanks indexes by position; move the replies to their ranks.
  std::vector<v1::ForwardResponse> by_rank(kWorld);
  for (int r : survivors) by_rank[r] = masked_got[r];
  ExpectEqualsReference(first_masked_step, survivors, live, by_rank);
  const absl::Duration to_mask = absl::Now() - killed;

  for (int r : survivors) {
    const v1::GetStatusResponse s = fake_->StatusOf(r);
    EXPECT_FALSE(s.group_broken()) << "rank " << r << ": " << s.broken_reason();
    EXPECT_THAT(s.masked_ranks(), ElementsAre(victim)) << "rank " << r;
    EXPECT_EQ(s.mask_round(), 1) << "rank " << r;
    EXPECT_EQ(s.mask_host(), victim == 0 ? 1 : 0) << "rank " << r;
  }

  // The masked group keeps serving: more steps, each equal to the masked
  // reference, with the lost expert reported whenever a token chose it.
  bool reported = false;
  for (int step = first_masked_step + 1; step < kSteps; ++step) {
    status = Step(step, survivors, &masked_got);
    for (size_t i = 0; i < survivors.size(); ++i) {
      ASSERT_TRUE(status[i].ok()) << "rank " << survivors[i] << ": " << status[i];
    }
    for (int r : survivors) by_rank[r] = masked_got[r];
    ExpectEqualsReference(step, survivors, live, by_rank);
    for (int r : survivors) {
      for (int id : by_rank[r].lost_experts()) reported = reported || id == lost_expert;
    }
  }
  EXPECT_TRUE(reported) << "no step chose expert " << lost_expert;
  std::cout << "[rank-mask] killed rank " << victim << ": first correct masked step "
            << absl::ToDoubleMilliseconds(to_mask) << " ms after the kill (" << attempts
            << " step attempts)" << std::endl;
}

INSTANTIATE_TEST_SUITE_P(Victims, RankMaskTest, ::testing::Values(0, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "kill_rank" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace moe_ep::testing

namespace moe_ep::testing {
namespace {

// A restarted rank rejoins (DESIGN §15; issue 17): rank 2 is killed with
// SIGKILL during step 3, the survivors mask it and serve step 3 again and
// step 4 under the mask (equal to the masked reference); ForwardLayers is
// refused under the mask by name; then rank 2's worker is restarted on its
// address, joins alone, is set up with the group's requests and Rejoin
// re-admits it: steps 5..7 on all four ranks equal the unmasked reference bit
// for bit, and GetStatus shows no mask.
class RankRejoinTest : public RankMaskTest {};

TEST_F(RankRejoinTest, RestartedRankRejoinsAndStepsEqualTheFullReference) {
  constexpr int kVictim = 2;
  const std::vector<int> all = {0, 1, 2, 3};
  const std::vector<int> survivors = {0, 1, 3};
  const std::vector<bool> everyone(kWorld, true);
  std::vector<bool> live(kWorld, true);
  live[kVictim] = false;

  std::vector<v1::ForwardResponse> got;
  for (int step = 0; step < kKillAtStep; ++step) {
    const std::vector<absl::Status> status = Step(step, all, &got);
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
    ExpectEqualsReference(step, all, everyone, got);
  }
  int attempts = 0;
  const absl::Duration to_mask = KillDuringStepAndMask({kVictim}, survivors, &attempts);
  ASSERT_NE(to_mask, absl::InfiniteDuration());

  // Under the mask: one more masked step, and ForwardLayers refused on every
  // survivor naming the lost rank (never a wrong number, never a hang).
  std::vector<absl::Status> status = Step(kKillAtStep + 1, survivors, &got);
  for (size_t i = 0; i < survivors.size(); ++i) {
    ASSERT_TRUE(status[i].ok()) << "rank " << survivors[i] << ": " << status[i];
  }
  std::vector<v1::ForwardResponse> by_rank(kWorld);
  for (int r : survivors) by_rank[r] = got[r];
  ExpectEqualsReference(kKillAtStep + 1, survivors, live, by_rank);
  status = OnRanks(survivors, [&](int r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ForwardLayersRequest request;
    request.set_epoch(1);
    request.mutable_stack()->set_seed(5);
    std::vector<float> tokens(2 * model_.hidden, 0.25f);
    *request.mutable_tokens() =
        server::EncodeFloat32(tokens, std::vector<int64_t>{2, model_.hidden});
    v1::ForwardLayersResponse response;
    return client::ToAbslStatus(fake_->stub(r).ForwardLayers(&context, request, &response));
  });
  for (size_t i = 0; i < survivors.size(); ++i) {
    EXPECT_EQ(status[i].code(), absl::StatusCode::kFailedPrecondition) << status[i];
    EXPECT_THAT(std::string(status[i].message()),
                ::testing::HasSubstr("ForwardLayers: rank(s) [2] of 4 are masked out"))
        << status[i];
  }

  // The restart: the same address, a fresh process; it joins alone and is
  // re-admitted at the step boundary.
  const absl::Time restarted = absl::Now();
  ASSERT_TRUE(fake_->RestartWorker(kVictim).ok());
  const absl::Time up = absl::Now();
  absl::StatusOr<v1::RejoinResponse> rejoined = fake_->coordinator().RejoinRank(kVictim, setup_);
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  EXPECT_TRUE(rejoined->masked_ranks().empty());
  EXPECT_EQ(rejoined->mask_round(), 2);
  const absl::Time readmitted = absl::Now();

  absl::Duration to_first_step;
  for (int step = kKillAtStep + 2; step < kSteps; ++step) {
    status = Step(step, all, &got);
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
    ExpectEqualsReference(step, all, everyone, got);
    for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(got[r].lost_experts().empty()) << "rank " << r;
    if (step == kKillAtStep + 2) to_first_step = absl::Now() - restarted;
  }
  for (int r = 0; r < kWorld; ++r) {
    const v1::GetStatusResponse s = fake_->StatusOf(r);
    EXPECT_FALSE(s.group_broken()) << "rank " << r << ": " << s.broken_reason();
    EXPECT_TRUE(s.masked_ranks().empty()) << "rank " << r;
    EXPECT_EQ(s.mask_round(), 2) << "rank " << r;
  }
  std::cout << "[rank-rejoin] killed rank " << kVictim << ": first correct masked step "
            << absl::ToDoubleMilliseconds(to_mask) << " ms after the kill (" << attempts
            << " step attempts); restart -> worker up "
            << absl::ToDoubleMilliseconds(up - restarted) << " ms, RejoinRank "
            << absl::ToDoubleMilliseconds(readmitted - up)
            << " ms, restart -> first correct unmasked step "
            << absl::ToDoubleMilliseconds(to_first_step) << " ms" << std::endl;
}

}  // namespace
}  // namespace moe_ep::testing

namespace moe_ep::testing {
namespace {

// Two ranks restarted together, rank 0 among them (DESIGN §15: the
// Rendezvous store must not die with rank 0): ranks 0 and 1 are killed with
// SIGKILL during step 3; ranks 2 and 3 mask them (rank 2's store hosts the
// rounds) and serve step 3 under the mask (expert 0, only on rank 0, is
// reported lost); both workers are restarted and one RejoinRanks re-admits
// them in a single mask round; steps 4..7 on all four ranks equal the
// unmasked reference bit for bit.
TEST_F(RankRejoinTest, TwoRanksRankZeroIncludedRejoinInOneRound) {
  const std::vector<int> victims = {0, 1};
  const std::vector<int> survivors = {2, 3};
  const std::vector<bool> everyone(kWorld, true);
  std::vector<v1::ForwardResponse> got;
  for (int step = 0; step < kKillAtStep; ++step) {
    const std::vector<absl::Status> status = Step(step, {0, 1, 2, 3}, &got);
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
    ExpectEqualsReference(step, {0, 1, 2, 3}, everyone, got);
  }
  int attempts = 0;
  const absl::Duration to_mask = KillDuringStepAndMask(victims, survivors, &attempts);
  ASSERT_NE(to_mask, absl::InfiniteDuration());
  const v1::GetStatusResponse masked = fake_->StatusOf(2);
  EXPECT_THAT(masked.masked_ranks(), ElementsAre(0, 1));
  EXPECT_EQ(masked.mask_host(), 2);
  EXPECT_EQ(fake_->StatusOf(3).mask_round(), masked.mask_round());

  const absl::Time restarted = absl::Now();
  for (int v : victims) ASSERT_TRUE(fake_->RestartWorker(v).ok());
  absl::StatusOr<v1::RejoinResponse> rejoined = fake_->coordinator().RejoinRanks(victims, setup_);
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  EXPECT_TRUE(rejoined->masked_ranks().empty());
  EXPECT_EQ(rejoined->mask_round(), masked.mask_round() + 1);  // one round for both
  EXPECT_EQ(rejoined->mask_host(), 2);
  const absl::Duration to_rejoined = absl::Now() - restarted;
  for (int step = kKillAtStep + 1; step < kSteps; ++step) {
    const std::vector<absl::Status> status = Step(step, {0, 1, 2, 3}, &got);
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
    ExpectEqualsReference(step, {0, 1, 2, 3}, everyone, got);
  }
  for (int r = 0; r < kWorld; ++r) {
    const v1::GetStatusResponse s = fake_->StatusOf(r);
    EXPECT_TRUE(s.masked_ranks().empty()) << "rank " << r;
    EXPECT_EQ(s.mask_round(), masked.mask_round() + 1) << "rank " << r;
  }
  std::cout << "[rank-rejoin] killed ranks 0 and 1: first correct masked step "
            << absl::ToDoubleMilliseconds(to_mask) << " ms after the kill (" << attempts
            << " step attempts, mask round " << masked.mask_round()
            << "); restart of both -> RejoinRanks done " << absl::ToDoubleMilliseconds(to_rejoined)
            << " ms" << std::endl;
}

}  // namespace
}  // namespace moe_ep::testing
