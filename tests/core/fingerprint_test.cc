#include "core/fingerprint.h"

#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

// Published FNV-1a 64 test vectors (the FNV reference's test suite).
TEST(Fingerprint64, ReferenceVectors) {
  EXPECT_EQ(Fingerprint64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fingerprint64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(Fingerprint64("foobar"), 0x85944171f73967e8ULL);
}

TEST(Hex64, ZeroPaddedLowerCase) {
  EXPECT_EQ(Hex64(0xabULL), "00000000000000ab");
  EXPECT_EQ(Hex64(0xaf63dc4c8601ec8cULL), "af63dc4c8601ec8c");
}

}  // namespace
}  // namespace moe_ep::core
