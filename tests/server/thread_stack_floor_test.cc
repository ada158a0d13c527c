#include "core/thread_stack_floor.h"

#include <pthread.h>

#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

TEST(EffectiveThreadStackBytes, RaisesSmallRequestsToTheFloor) {
  EXPECT_EQ(core::EffectiveThreadStackBytes(40512), size_t{1} << 20);  // civetweb's request
  EXPECT_EQ(core::EffectiveThreadStackBytes(0), size_t{1} << 20);
  EXPECT_EQ(core::EffectiveThreadStackBytes(size_t{8} << 20), size_t{8} << 20);
}

// The interposer is what a shared library calling pthread_attr_setstacksize
// reaches: a 40 KB request reads back as 1 MiB, an 8 MiB one unchanged.
TEST(ThreadStackFloor, SetStackSizeIsRaisedThroughTheInterposer) {
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  size_t got = 0;
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 40512), 0);
  ASSERT_EQ(pthread_attr_getstacksize(&attr, &got), 0);
  EXPECT_EQ(got, size_t{1} << 20);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, size_t{8} << 20), 0);
  ASSERT_EQ(pthread_attr_getstacksize(&attr, &got), 0);
  EXPECT_EQ(got, size_t{8} << 20);
  pthread_attr_destroy(&attr);
}

}  // namespace
}  // namespace moe_ep::server
