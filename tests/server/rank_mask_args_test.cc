// The rank-mask inputs of a worker (DESIGN §15; issue 17 item 3): Join's
// rendezvous_addresses (one per rank or none, entry 0 = rendezvous_address;
// bad lists are refused naming the entry) and PlacementBook's masked tables.

#include <memory>
#include <string>

#include "core/placement_book.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/request_limits.h"
#include "server/request_options.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::JoinRequest Join(int world) {
  v1::JoinRequest r;
  r.set_world_size(world);
  r.set_rank(1);
  r.set_generation(2);
  r.set_backend("gloo");
  r.set_rendezvous_address("127.0.0.1:5000");
  return r;
}

TEST(RankMaskArgs, RendezvousAddressesAreOnePerRankOrNone) {
  const JoinDefaults defaults;
  v1::JoinRequest r = Join(3);
  absl::StatusOr<JoinArgs> none = JoinArgsFromRequest(RequestLimits(), r, defaults);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->rendezvous_addresses.empty());
  for (const char* a : {"127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"}) {
    r.add_rendezvous_addresses(a);
  }
  absl::StatusOr<JoinArgs> all = JoinArgsFromRequest(RequestLimits(), r, defaults);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT(all->rendezvous_addresses,
              ElementsAre("127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"));

  v1::JoinRequest short_list = Join(3);
  short_list.add_rendezvous_addresses("127.0.0.1:5000");
  absl::Status s = JoinArgsFromRequest(RequestLimits(), short_list, defaults).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("expected one per rank (world_size 3)"));

  v1::JoinRequest empty_entry = r;
  empty_entry.set_rendezvous_addresses(2, "");
  s = JoinArgsFromRequest(RequestLimits(), empty_entry, defaults).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("rendezvous_addresses[2]"));

  v1::JoinRequest other_first = r;
  other_first.set_rendezvous_addresses(0, "127.0.0.1:6000");
  s = JoinArgsFromRequest(RequestLimits(), other_first, defaults).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("rendezvous_addresses[0]: expected rank 0's"));
}

TEST(RankMaskArgs, ThePlacementBookServesEveryTableUnderTheMask) {
  core::PlacementBook book;
  book.Reset(
      std::make_shared<const core::PlacementTable>(core::PlacementTable::Contiguous(4, 2).value()));
  book.Install(1, std::make_shared<const core::PlacementTable>(
                      core::PlacementTable::FromSlotExperts(4, {{0, 1, 3}, {2, 3, 1}}).value()));
  book.SetLive({true, false});
  EXPECT_THAT(book.Placement(0)->LostExperts(), ElementsAre(2, 3));
  EXPECT_THAT(book.Placement(1)->LostExperts(), ElementsAre(2));
  EXPECT_EQ(book.Placement(1), book.Placement(1));  // made once
  EXPECT_FALSE(book.contiguous()->masked());
  book.SetLive({true, true});
  EXPECT_FALSE(book.Placement(0)->masked());
  EXPECT_EQ(book.Placement(0), book.contiguous());
}

}  // namespace
}  // namespace moe_ep::server
