#pragma once

// Stable digests of canonical text, equal on every rank and across processes
// (unlike std::hash or absl::Hash, which are seeded per process). Used to check
// that ranks agree on a configuration: the layer plan (DESIGN §3), the expert
// placement table (DESIGN §15), the cross-rank vote's fields (core/agreement.h),
// pinned seeded-weight bits (tests). The tree's one fingerprint (issue 10
// item 4); the earlier copies used an offset basis one digit short of FNV's.

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace moe_ep::core {

// Fingerprint64()
//
// Returns the 64-bit FNV-1a digest of `text` (offset basis
// 0xcbf29ce484222325, prime 0x100000001b3), byte by byte.
//
// Pure and thread-safe. Source: FNV reference (Fowler, Noll, Vo).
// Example: Fingerprint64("") == 0xcbf29ce484222325, Fingerprint64("a") ==
// 0xaf63dc4c8601ec8c.
uint64_t Fingerprint64(absl::string_view text);

// Hex64()
//
// Returns `value` as 16 lower-case hex digits, zero-padded.
// Example: Hex64(0xab) == "00000000000000ab". Pure and thread-safe.
std::string Hex64(uint64_t value);

}  // namespace moe_ep::core
