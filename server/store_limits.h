#pragma once

// Limits of the Rendezvous store (server/rendezvous_service.h; issue 13
// item 10), flags --store-max-* of moe-ep-worker (server/worker_flags.h),
// and the metadata key of the per-generation rendezvous secret. Plain data.

#include <cstdint>
#include <string_view>

namespace moe_ep::server {

// Metadata key of the per-generation rendezvous secret (server/grpc_store.h
// sends it with every call when Join gave one).
inline constexpr char kSecretMetadataKey[] = "x-moe-ep-rendezvous-secret";
inline constexpr int64_t kMaxSecretBytes = 1024;

// Whether `secret` can be sent as the value of kSecretMetadataKey: at most
// kMaxSecretBytes of printable ASCII (0x20-0x7E). gRPC aborts the process
// on any other byte in a header value (API misuse: the long fuzz run of
// bench/results/fuzz-long/README.md run 7 crashed three workers with a
// Join's mutated rendezvous_secret), so JoinRequest checks it and the store
// client never sends another. Thread-safe (pure).
inline bool IsSendableSecret(std::string_view secret) {
  if (static_cast<int64_t>(secret.size()) > kMaxSecretBytes) return false;
  for (const char c : secret) {
    if (c < 0x20 || c > 0x7E) return false;
  }
  return true;
}

struct StoreLimits {
  int64_t max_key_bytes = 512;
  int64_t max_value_bytes = int64_t{1} << 20;  // Gloo addresses and NCCL ids are < 1 KiB
  int64_t max_keys = 65536;
  // Keys + values held. The worker carves this budget out of its memory cap
  // (server/main.cc), so the store counts in the cap.
  int64_t max_total_bytes = int64_t{16} << 20;
  int64_t max_wait_keys = 4096;  // keys of one Wait
  // Writes need a generation opened by OpenGeneration (the worker's mode);
  // false: any key may be written (a bare store, as in unit tests).
  bool require_open_generation = false;
};

}  // namespace moe_ep::server
