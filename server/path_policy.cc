#include "server/path_policy.h"

#include <sys/stat.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe_ep::server {
namespace {

namespace fs = std::filesystem;

// `path` equals `dir` or lies below it (both normalized, absolute).
bool IsUnder(const fs::path& path, const fs::path& dir) {
  auto p = path.begin();
  for (auto d = dir.begin(); d != dir.end(); ++d, ++p) {
    if (d->empty()) continue;  // a trailing separator
    if (p == path.end() || *p != *d) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> ResolveCheckpointPath(const std::vector<std::string>& allowed_dirs,
                                                  const std::string& path, int64_t max_file_bytes) {
  if (allowed_dirs.empty()) {
    return absl::PermissionDeniedError(
        "safetensors_path: this worker reads no checkpoints; start it with --checkpoint-dir DIR "
        "(repeatable) naming the directories it may read");
  }
  const fs::path requested(path);
  if (!requested.is_absolute()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors_path: expected an absolute path, got \"", path, "\""));
  }
  const std::string dirs = absl::StrJoin(allowed_dirs, ", ");
  std::vector<fs::path> roots;
  bool lexically_under = false;
  for (const std::string& dir : allowed_dirs) {
    std::error_code ec;
    const fs::path root = fs::canonical(dir, ec);
    if (ec) continue;
    roots.push_back(root);
    lexically_under = lexically_under || IsUnder(requested.lexically_normal(), root) ||
                      IsUnder(requested.lexically_normal(), fs::path(dir).lexically_normal());
  }
  std::error_code ec;
  const fs::path resolved = fs::canonical(requested, ec);
  if (ec) {
    if (lexically_under) {
      return absl::NotFoundError(absl::StrCat("safetensors_path: \"", path, "\" does not exist"));
    }
    return absl::PermissionDeniedError(absl::StrCat("safetensors_path: \"", path,
                                                    "\" is outside the checkpoint directories (",
                                                    dirs, "; --checkpoint-dir)"));
  }
  bool allowed = false;
  for (const fs::path& root : roots) allowed = allowed || IsUnder(resolved, root);
  if (!allowed) {
    return absl::PermissionDeniedError(absl::StrCat("safetensors_path: \"", path,
                                                    "\" is outside the checkpoint directories (",
                                                    dirs, "; --checkpoint-dir)"));
  }
  struct stat st;
  if (::stat(resolved.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("safetensors_path: \"", path, "\" does not exist"));
  }
  if (S_ISDIR(st.st_mode)) return resolved.string();
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors_path: \"", path,
        "\" is not a regular file or a directory (a pipe, device or socket is refused)"));
  }
  if (st.st_size > max_file_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("safetensors_path: \"", path, "\" has ",
                                                     st.st_size, " bytes, more than the ",
                                                     max_file_bytes, " of --max-file-bytes"));
  }
  return resolved.string();
}

}  // namespace moe_ep::server
