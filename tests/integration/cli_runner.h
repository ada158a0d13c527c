#pragma once

// Runs the built moe-ep binary with a command line, for the CLI tests.

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace moe_ep::testing {

struct CliResult {
  int exit_code = -1;
  std::string output;  // stdout, plus stderr when asked
};

inline std::string MoeEpBinary() { return std::string(MOE_EP_BINARY_DIR) + "/client/moe-ep"; }

// `moe-ep <args>`; stderr joins the output when `with_stderr`, else it is
// discarded. exit_code is 128 + signal for a killed process.
inline CliResult RunMoeEp(const std::string& args, bool with_stderr = true) {
  CliResult result;
  const std::string command = MoeEpBinary() + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace moe_ep::testing
