#include "proto/rpc/status_conversion.h"

#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

TEST(ToGrpcStatus, OkIsOk) { EXPECT_TRUE(rpc::ToGrpcStatus(absl::OkStatus()).ok()); }

TEST(ToGrpcStatus, KeepsCodeAndMessage) {
  grpc::Status s = rpc::ToGrpcStatus(absl::ResourceExhaustedError("R 9 > capacity 8"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(), "R 9 > capacity 8");
}

TEST(ToGrpcStatus, EveryCanonicalCodeKeepsItsNumber) {
  for (int code = 1; code <= 16; ++code) {
    absl::Status status(static_cast<absl::StatusCode>(code), "x");
    EXPECT_EQ(static_cast<int>(rpc::ToGrpcStatus(status).error_code()), code) << code;
  }
  EXPECT_EQ(rpc::ToGrpcStatus(absl::AbortedError("a")).error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(rpc::ToGrpcStatus(absl::FailedPreconditionError("a")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace moe_ep::server
