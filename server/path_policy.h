#pragma once

// Which checkpoint files a LoadExperts request may name (issue 13 items 6
// and 9): only regular files (or checkpoint directories) under the worker's
// configured checkpoint directories (--checkpoint-dir, repeatable), resolved
// through symbolic links, no larger than --max-file-bytes. A named pipe, a
// device or a socket is refused before it is opened, so LoadExperts never
// blocks on one. Source: DESIGN §8; issue 13.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe_ep::server {

// ResolveCheckpointPath()
//
// The canonical path (symbolic links resolved) of `path` when it lies under
// one of `allowed_dirs` (each canonicalized too; a directory that does not
// exist allows nothing) and is a regular file of at most `max_file_bytes`
// or a directory. Errors (none echoes anything read from a file):
//   PERMISSION_DENIED  no allowed directory is configured, or `path`
//                      resolves outside every one of them;
//   NOT_FOUND          `path` lies under an allowed directory but does not
//                      exist;
//   INVALID_ARGUMENT   `path` is relative, or neither a regular file nor a
//                      directory (a pipe, device or socket);
//   RESOURCE_EXHAUSTED the file is larger than `max_file_bytes`.
// Reads the file system only (stat, realpath); thread-safe.
absl::StatusOr<std::string> ResolveCheckpointPath(const std::vector<std::string>& allowed_dirs,
                                                  const std::string& path, int64_t max_file_bytes);

}  // namespace moe_ep::server
