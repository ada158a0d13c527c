#include "server/data_plane_host.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace moe_ep::server {

absl::StatusOr<std::string> ResolveDataPlaneHost(const std::string& flag,
                                                 const char* gloo_socket_ifname) {
  if (!flag.empty()) return flag;
  if (gloo_socket_ifname == nullptr || gloo_socket_ifname[0] == '\0') return "127.0.0.1";
  const std::string name(*absl::StrSplit(gloo_socket_ifname, ',').begin());
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::InternalError(absl::StrCat("getifaddrs: ", strerror(errno)));
  }
  std::string address;
  bool found = false;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_name == nullptr || name != a->ifa_name) continue;
    found = true;
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) {
      address = text;
      break;
    }
  }
  freeifaddrs(list);
  if (!address.empty()) return address;
  return absl::InvalidArgumentError(
      absl::StrCat("GLOO_SOCKET_IFNAME=", gloo_socket_ifname, ": interface '", name, "' ",
                   found ? "has no IPv4 address" : "does not exist",
                   "; set it to an interface with an IPv4 address, or pass --data-plane-host"));
}

}  // namespace moe_ep::server
