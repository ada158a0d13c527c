#include "client/target_resolver.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/targets.h"
#include "core/status_macros.h"

namespace moe_ep::client {

HostLookup SystemHostLookup() {
  return [](const std::string& host) -> absl::StatusOr<std::vector<std::string>> {
    addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (rc != 0) {
      return absl::UnavailableError(
          absl::StrCat("host ", host, " does not resolve: ", gai_strerror(rc)));
    }
    std::vector<std::string> out;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* addr =
          a->ai_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
      if (inet_ntop(a->ai_family, addr, text, sizeof(text)) != nullptr) out.emplace_back(text);
    }
    freeaddrinfo(found);
    if (out.empty()) return absl::UnavailableError(absl::StrCat("host ", host, " has no address"));
    return out;
  };
}

std::vector<std::string> HeadlessServiceTargets(const v1::HeadlessService& service) {
  const std::string prefix = service.pod_prefix().empty()
                                 ? std::string(*absl::StrSplit(service.service(), '.').begin())
                                 : service.pod_prefix();
  const int procs = service.procs_per_pod() > 0 ? service.procs_per_pod() : 1;
  std::vector<std::string> out;
  for (int p = 0; p < service.replicas(); ++p) {
    for (int l = 0; l < procs; ++l) {
      out.push_back(absl::StrCat(prefix, "-", p, ".", service.service(), ":",
                                 service.port() + p * service.port_step() + l));
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> DefaultTargetResolver::Resolve(
    const v1::DesiredState& state) {
  if (!state.has_headless_service()) {
    return std::vector<std::string>(state.targets().begin(), state.targets().end());
  }
  std::vector<std::string> targets = HeadlessServiceTargets(state.headless_service());
  for (const std::string& target : targets) {
    ASSIGN_OR_RETURN(HostPort hp, SplitHostPort(target));
    auto addresses = lookup_(hp.host);
    if (!addresses.ok()) {
      return absl::UnavailableError(absl::StrCat("headless_service ",
                                                 state.headless_service().service(), ": ",
                                                 addresses.status().message()));
    }
  }
  return targets;
}

}  // namespace moe_ep::client
