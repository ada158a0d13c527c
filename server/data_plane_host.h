#pragma once

// The address the Gloo TCP data plane binds to when Join names none
// (DESIGN §12; issue 9 item 11). Multi-node recipes (llm-d, SGLang, PyTorch)
// name the interface instead of the address: GLOO_SOCKET_IFNAME=eth0. Gloo
// itself reads no environment variable, so the worker resolves it here.

#include <string>

#include "absl/status/statusor.h"

namespace moe_ep::server {

// ResolveDataPlaneHost()
//
// Returns `flag` when it is not empty (--data-plane-host wins); else, when
// `gloo_socket_ifname` is non-null and not empty, the first IPv4 address of
// that interface (e.g. "lo" -> "127.0.0.1"); else "127.0.0.1".
// Only the first name of a comma-separated list is used (Gloo binds one
// device per group).
// Errors: kInvalidArgument when the interface does not exist or has no IPv4
// address (names the interface and the variable); kInternal when the
// interfaces cannot be listed (getifaddrs failed).
// Thread-safe.
absl::StatusOr<std::string> ResolveDataPlaneHost(const std::string& flag,
                                                 const char* gloo_socket_ifname);

}  // namespace moe_ep::server
