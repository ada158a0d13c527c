#include "core/logging.h"

#include <memory>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "spdlog/logger.h"
#include "spdlog/sinks/ostream_sink.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// Logs `message` at info through a logger with `format`'s formatter.
std::string LogOnce(const std::string& format, const std::string& message,
                    core::LogFields fields = core::LogFields::kWorker) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::logger logger("test-logger", sink);
  auto formatter = core::MakeLogFormatter(format, fields);
  EXPECT_TRUE(formatter.ok()) << formatter.status();
  logger.set_formatter(std::move(*formatter));
  logger.info("{}", message);
  return out.str();
}

TEST(LogFormat, JsonLinesCarryRankGenerationEpochAndEscapedMessage) {
  core::SetLogContext(1, 3, 7);
  const std::string line = LogOnce("json", "Join: \"quoted\"\nsecond line");
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1);  // one line
  const nlohmann::json j = nlohmann::json::parse(line);
  EXPECT_EQ(j["rank"], 1);
  EXPECT_EQ(j["generation"], 3);
  EXPECT_EQ(j["epoch"], 7);
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["logger"], "test-logger");
  EXPECT_EQ(j["msg"], "Join: \"quoted\"\nsecond line");
  EXPECT_THAT(j["ts"].get<std::string>(),
              MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6}Z"));
  core::SetLogContext(-1, 0, 0);
}

TEST(LogFormat, JsonBeforeJoinHasNullFields) {
  core::SetLogContext(-1, 0, 0);
  const nlohmann::json j = nlohmann::json::parse(LogOnce("json", "starting"));
  EXPECT_TRUE(j["rank"].is_null());
  EXPECT_TRUE(j["generation"].is_null());
  EXPECT_TRUE(j["epoch"].is_null());
}

TEST(LogFormat, TextShowsTheContextField) {
  core::SetLogContext(2, 5, 11);
  EXPECT_THAT(LogOnce("text", "hello"), HasSubstr("[rank=2 gen=5 epoch=11] hello"));
  core::SetLogContext(-1, 0, 0);
  EXPECT_THAT(LogOnce("text", "hello"), HasSubstr("[rank=- gen=- epoch=-] hello"));
}

// The coordinator's lines (issue 31 item 5): time and level, no worker fields.
TEST(LogFormat, PlainFieldsCarryTimeAndLevelButNoWorkerFields) {
  core::SetLogContext(2, 5, 11);
  const std::string text = LogOnce("text", "generation 3: formed", core::LogFields::kPlain);
  EXPECT_THAT(text,
              MatchesRegex("\\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}\\] "
                           "\\[info\\] generation 3: formed\n"));
  const nlohmann::json j =
      nlohmann::json::parse(LogOnce("json", "generation 3: formed", core::LogFields::kPlain));
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["msg"], "generation 3: formed");
  EXPECT_TRUE(j.contains("ts"));
  EXPECT_FALSE(j.contains("rank"));
  EXPECT_FALSE(j.contains("generation"));
  EXPECT_FALSE(j.contains("epoch"));
  core::SetLogContext(-1, 0, 0);
}

TEST(LogFormat, UnknownFormatIsInvalidArgument) {
  auto formatter = core::MakeLogFormatter("yaml");
  EXPECT_EQ(formatter.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(formatter.status().message(), HasSubstr("--log-format"));
  EXPECT_THAT(formatter.status().message(), HasSubstr("yaml"));
}

}  // namespace
}  // namespace moe_ep::server
