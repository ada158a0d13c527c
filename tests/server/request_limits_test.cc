#include "server/request_limits.h"

#include <limits>
#include <new>
#include <stdexcept>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

TEST(RequestLimits, BenchmarkBoundsEachSizeAndTheSamplerWork) {
  RequestLimits limits;
  v1::BenchmarkRequest request;
  request.set_tokens_per_rank(4096);
  request.set_hidden_size(7168);
  request.set_top_k(8);
  request.set_num_experts(256);
  request.set_iterations(20);
  EXPECT_TRUE(CheckBenchmark(limits, request).ok());
  request.set_top_k(65);
  absl::Status status = CheckBenchmark(limits, request);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "top_k: expected <= 64 (--max-top-k), got 65");
  // 2^20 tokens x 64 x 4096 experts = 2^38 draws > 2^30.
  request.set_top_k(64);
  request.set_num_experts(4096);
  request.set_tokens_per_rank(int64_t{1} << 20);
  status = CheckBenchmark(limits, request);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("got 274877906944"));
}

TEST(RequestLimits, JoinBoundsWorldGenerationAndTimeout) {
  RequestLimits limits;
  limits.max_world_size = 8;
  v1::JoinRequest request;
  request.set_world_size(8);
  request.set_generation(int64_t{1} << 53);
  EXPECT_TRUE(CheckJoin(limits, request).ok());
  request.set_world_size(9);
  EXPECT_EQ(CheckJoin(limits, request).message(),
            "world_size: expected <= 8 (--max-world-size), got 9");
  // The generation's bound is CheckJoin's of server/group_formation.h.
  request.set_world_size(1);
  request.set_generation(std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(CheckJoin(limits, request).ok());
  request.set_timeout_ms(limits.max_timeout_ms + 1);
  EXPECT_EQ(CheckJoin(limits, request).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestLimits, ForwardRowsAreBounded) {
  RequestLimits limits;
  limits.max_tokens = 10;
  v1::ForwardRequest request;
  request.mutable_hidden_states()->add_shape(11);
  request.mutable_hidden_states()->add_shape(4);
  EXPECT_EQ(CheckForward(limits, request).message(),
            "hidden_states.shape[0]: expected <= 10 (--max-tokens), got 11");
}

TEST(RequestLimits, CapMessageCutsLongMessagesOnly) {
  const absl::Status short_status = absl::InvalidArgumentError("short");
  EXPECT_EQ(CapMessage(short_status), short_status);
  const absl::Status cut = CapMessage(absl::InvalidArgumentError(std::string(20000, 'x')));
  EXPECT_EQ(cut.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cut.message(), std::string(kMaxErrorMessageBytes, 'x') + " ... (17952 bytes cut)");
  // A 2-byte UTF-8 character across the cut is kept whole or dropped whole.
  const std::string text = std::string(kMaxErrorMessageBytes - 1, 'a') + "\xc3\xa9" + "tail";
  const absl::Status utf8 = CapMessage(absl::InternalError(text));
  EXPECT_EQ(utf8.message().substr(0, kMaxErrorMessageBytes),
            std::string(kMaxErrorMessageBytes - 1, 'a') + " ");
}

TEST(RequestLimits, RunGuardedTurnsExceptionsIntoStatuses) {
  EXPECT_TRUE(RunGuarded("X", [] { return absl::OkStatus(); }).ok());
  const absl::Status oom =
      RunGuarded("LoadExperts", []() -> absl::Status { throw std::bad_alloc(); });
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(oom.message(), HasSubstr("LoadExperts"));
  const absl::Status big =
      RunGuarded("Forward", []() -> absl::Status { throw std::length_error("vector"); });
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  const absl::Status other =
      RunGuarded("Join", []() -> absl::Status { throw std::runtime_error("boom"); });
  EXPECT_EQ(other.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(other.message(), HasSubstr("boom"));
}

}  // namespace
}  // namespace moe_ep::server
