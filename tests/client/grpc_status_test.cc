#include "client/grpc_status.h"

#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

TEST(ToAbslStatus, KeepsCodeAndMessage) {
  EXPECT_TRUE(ToAbslStatus(grpc::Status::OK).ok());
  const absl::Status s =
      ToAbslStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "R 9 > capacity 4"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "R 9 > capacity 4");
  EXPECT_EQ(ToAbslStatus(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "late")).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ToAbslStatus(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "x")).code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(ToAbslStatus, OutOfRangeCodeIsUnknown) {
  const absl::Status s = ToAbslStatus(grpc::Status(static_cast<grpc::StatusCode>(42), "odd"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(s.message(), "gRPC status code 42: odd");
}

}  // namespace
}  // namespace moe_ep::client
