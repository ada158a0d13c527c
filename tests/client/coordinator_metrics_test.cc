#include "client/service/coordinator_metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace moe_ep::client {
namespace {

// GET http://127.0.0.1:port/metrics with a plain socket (HTTP/1.0: the server
// closes when done). Returns the whole response, headers included.
std::string HttpGet(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

TEST(CoordinatorMetrics, ExposesTheSnapshotAndTheHistograms) {
  v1::GetGroupResponse g;
  g.set_generation(7);
  g.set_phase(v1::GROUP_PHASE_READY);
  g.set_formations(3);
  g.set_last_form_seconds(0.25);
  v1::RankView* r = g.add_ranks();
  r->set_rank(1);
  r->set_target("127.0.0.1:5");
  r->set_state(v1::RANK_STATE_READY);
  CoordinatorMetrics metrics([g] { return g; });
  v1::GroupEvent formed;
  formed.set_kind("formed");
  formed.set_seconds(0.3);
  metrics.RecordEvent(formed);
  ASSERT_TRUE(metrics.Serve("127.0.0.1:0").ok());
  EXPECT_GT(metrics.port(), 0);
  // The registry part (histograms) as the exposer would write it.
  const std::string text = prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  EXPECT_NE(text.find("moe_ep_coordinator_form_seconds_count 1"), std::string::npos) << text;
  EXPECT_NE(text.find("moe_ep_coordinator_form_seconds_sum 0.3"), std::string::npos) << text;
  // The snapshot part, read at scrape time.
  const std::string page = HttpGet(metrics.port());
  EXPECT_NE(page.find("moe_ep_coordinator_generation 7"), std::string::npos) << page;
  EXPECT_NE(page.find("moe_ep_coordinator_group_ready 1"), std::string::npos) << page;
  EXPECT_NE(page.find("moe_ep_coordinator_reforms_total 2"), std::string::npos) << page;
  EXPECT_NE(page.find("moe_ep_coordinator_last_form_seconds 0.25"), std::string::npos) << page;
  EXPECT_NE(page.find("moe_ep_coordinator_rank_state{rank=\"1\",state=\"RANK_STATE_READY\","
                      "target=\"127.0.0.1:5\"} 1"),
            std::string::npos)
      << page;
  EXPECT_NE(page.find("moe_ep_coordinator_form_seconds_count 1"), std::string::npos) << page;
  metrics.StopServing();
}

}  // namespace
}  // namespace moe_ep::client
