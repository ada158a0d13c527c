// Hostile files handed to the safetensors reader (issue 13 items 6 and 9):
// refused without blocking and without quoting their bytes.

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

fs::path Dir() {
  fs::path dir = fs::path(::testing::TempDir()) / "safetensors_hostile";
  fs::create_directories(dir);
  return dir;
}

TEST(SafetensorsHostile, ANamedPipeIsRefusedWithoutBlocking) {
  const fs::path fifo = Dir() / "pipe.safetensors";
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Before: open() waited for a writer forever.
  auto file = SafetensorsFile::Open(fifo.string());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr("not a regular file"));
}

TEST(SafetensorsHostile, ErrorsDoNotQuoteTheFile) {
  // "root:*:2" as the header length: far above the file.
  const fs::path shadow = Dir() / "shadow";
  std::ofstream(shadow) << "root:*:20000:0:99999:7:::\n";
  auto length = SafetensorsFile::Open(shadow.string());
  EXPECT_EQ(length.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(length.status().message(), Not(HasSubstr("root")));
  EXPECT_THAT(length.status().message(), Not(HasSubstr("3619251681095544690")));  // the length
  // A plausible length whose header is not JSON: the parser's message quotes bytes.
  const fs::path text = Dir() / "text";
  {
    std::ofstream out(text, std::ios::binary);
    const uint64_t header = 12;
    char le[8];
    std::memcpy(le, &header, 8);
    out.write(le, 8);
    out << "secret-words";
  }
  auto json = SafetensorsFile::Open(text.string());
  EXPECT_EQ(json.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(json.status().message(), Not(HasSubstr("secret")));
}

TEST(SafetensorsHostile, AnIndexShardMayNotLeaveItsDirectory) {
  const fs::path dir = Dir() / "index";
  fs::create_directories(dir);
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map": {"w": "../../etc/passwd"}})";
  auto ckpt = SafetensorsCheckpoint::Open(dir.string());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("not a file name"));
}

}  // namespace
}  // namespace moe_ep::core
