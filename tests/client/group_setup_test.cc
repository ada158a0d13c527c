#include "client/group_setup.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

GroupSetupOptions Configured() {
  GroupSetupOptions o;
  o.hidden = 256;
  o.num_experts = 8;
  o.top_k = 2;
  o.capacity_tokens = 16;
  return o;
}

TEST(ValidateGroupSetup, AcceptsTheDefaultsAndBothConventions) {
  EXPECT_TRUE(ValidateGroupSetup(GroupSetupOptions{}, 2).ok());
  GroupSetupOptions o = Configured();
  EXPECT_TRUE(ValidateGroupSetup(o, 2).ok());
  o.invalid_expert_id = "num_experts";
  o.dispatch_dtype = "fp8_e4m3";
  o.group_timeout_s = 3600;
  EXPECT_TRUE(ValidateGroupSetup(o, 2).ok());
}

// Issue 30: the group timeout, the invalid-id convention and the dispatch
// dtype are flags of `moe-ep up`, each checked naming the flag.
TEST(ValidateGroupSetup, NamesTheFlagOfABadValue) {
  GroupSetupOptions o = Configured();
  o.group_timeout_s = 0;
  absl::Status s = ValidateGroupSetup(o, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("--group-timeout: expected seconds in (0, 3600], got 0"));
  o.group_timeout_s = 3601;
  EXPECT_EQ(ValidateGroupSetup(o, 2).code(), absl::StatusCode::kInvalidArgument);
  GroupSetupOptions form_only;  // checked even when only forming
  form_only.group_timeout_s = -1;
  EXPECT_EQ(ValidateGroupSetup(form_only, 2).code(), absl::StatusCode::kInvalidArgument);

  o = Configured();
  o.invalid_expert_id = "-2";
  EXPECT_THAT(std::string(ValidateGroupSetup(o, 2).message()),
              HasSubstr("--invalid-expert-id: expected -1 or num_experts, got '-2'"));
  o = Configured();
  o.dispatch_dtype = "nvfp4";
  EXPECT_THAT(std::string(ValidateGroupSetup(o, 2).message()),
              HasSubstr("--dispatch-dtype: expected bf16 or fp8_e4m3, got 'nvfp4'"));
}

}  // namespace
}  // namespace moe_ep::client
