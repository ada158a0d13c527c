#include "proto/rpc/auth.h"

#include <filesystem>
#include <string>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_certs.h"

namespace moe_ep::server {
namespace {

using ::moe_ep::testing::WriteTextFile;
using ::testing::HasSubstr;

class BearerTokenAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() / ("moe-ep-auth-test-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "token").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Process() on metadata {"authorization": value} (or none when null).
  grpc::Status Check(rpc::BearerTokenAuth& auth, const char* value,
                     grpc::AuthMetadataProcessor::OutputMetadata* consumed) {
    grpc::AuthMetadataProcessor::InputMetadata input;
    if (value != nullptr)
      input.insert({grpc::string_ref("authorization"), grpc::string_ref(value)});
    grpc::AuthMetadataProcessor::OutputMetadata response;
    return auth.Process(input, nullptr, consumed, &response);
  }

  std::filesystem::path dir_;
  std::string path_;
};

TEST_F(BearerTokenAuthTest, AcceptsOnlyTheBearerToken) {
  WriteTextFile(path_, "  abc123\n");
  auto auth = rpc::BearerTokenAuth::Create(path_);
  ASSERT_TRUE(auth.ok()) << auth.status();
  grpc::AuthMetadataProcessor::OutputMetadata consumed;
  EXPECT_TRUE(Check(**auth, "Bearer abc123", &consumed).ok());
  EXPECT_EQ(consumed.count("authorization"), 1u);  // handlers never see it

  grpc::Status missing = Check(**auth, nullptr, &consumed);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(missing.error_message(), HasSubstr("missing"));
  grpc::Status basic = Check(**auth, "Basic abc123", &consumed);
  EXPECT_EQ(basic.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(basic.error_message(), HasSubstr("expected \"Bearer <token>\""));
  for (const char* wrong : {"Bearer abc12", "Bearer abc1234", "Bearer ABC123", "Bearer "}) {
    grpc::Status status = Check(**auth, wrong, &consumed);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << wrong;
    EXPECT_THAT(status.error_message(), HasSubstr("does not match"));
  }
}

TEST_F(BearerTokenAuthTest, RotatedTokenFileTakesEffect) {
  WriteTextFile(path_, "old-token");
  auto auth = rpc::BearerTokenAuth::Create(path_);
  ASSERT_TRUE(auth.ok());
  grpc::AuthMetadataProcessor::OutputMetadata consumed;
  ASSERT_TRUE(Check(**auth, "Bearer old-token", &consumed).ok());
  WriteTextFile(path_, "the-new-token");  // another size: detected even with coarse mtimes
  EXPECT_EQ(Check(**auth, "Bearer old-token", &consumed).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Check(**auth, "Bearer the-new-token", &consumed).ok());
  // A rotation that empties the file keeps the token in force.
  WriteTextFile(path_, "");
  EXPECT_EQ((*auth)->CurrentToken(), "the-new-token");
}

TEST_F(BearerTokenAuthTest, MissingOrEmptyFileIsInvalidArgument) {
  auto missing = rpc::BearerTokenAuth::Create(path_ + ".missing");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("cannot read"));
  WriteTextFile(path_, " \n");
  auto empty = rpc::BearerTokenAuth::Create(path_);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("holds no token"));
}

}  // namespace
}  // namespace moe_ep::server
