#pragma once

// Stable digests of canonical text, equal on every rank and across processes
// (unlike std::hash or absl::Hash, which are seeded per process). Used to check
// that ranks agree on a configuration: the layer plan (DESIGN §3), the expert
// placement table (DESIGN §15).

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace moe_ep::core {

// Fnv1a64()
//
// Returns the 64-bit FNV-1a digest of `text` (offset basis
// 0xcbf29ce484222325, prime 0x100000001b3), byte by byte.
//
// Pure and thread-safe. Source: FNV reference (Fowler, Noll, Vo).
// Example: Fnv1a64("") == 0xcbf29ce484222325, Fnv1a64("a") ==
// 0xaf63dc4c8601ec8c.
uint64_t Fnv1a64(absl::string_view text);

// Hex64()
//
// Returns `value` as 16 lower-case hex digits, zero-padded.
// Example: Hex64(0xab) == "00000000000000ab". Pure and thread-safe.
std::string Hex64(uint64_t value);

}  // namespace moe_ep::core
