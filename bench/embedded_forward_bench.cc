// In-process `moe_ep_forward` (server/moe_ep.h) against the `Forward` RPC on
// the same layer of the same worker (issue 16 item 5; DESIGN §14): one
// embedded nccl worker on CUDA device 0, EP 1, the group formed by
// `moe-ep up --targets` with seeded SwiGLU experts; T tokens with uniform
// top-K routing (seeded).
//   in-process: device inputs, moe_ep_forward on a caller stream, then
//     cudaStreamSynchronize; p50 / p99 over --iterations after --warmup,
//     plus the p50 of the call's own return (it only enqueues);
//   RPC: a second process (bench/forward_rpc_client.cc, gRPC over
//     loopback, the way an orchestrator calls it) sends the same host
//     tensors (bench/forward_bench_inputs.h) in a ForwardRequest and times
//     the call. It is its own program: libmoe_ep.so and an RPC client in
//     one process would register the same protobuf descriptors twice in
//     the shared libprotobuf.
// The two outputs must be equal bit for bit (same kernels): the program
// fails otherwise. Prints one JSON object (and writes it to --json).

#include <cuda_runtime.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/forward_bench_inputs.h"
#include "server/moe_ep.h"

extern char** environ;

namespace {

using moe_ep::bench::Inputs;
using moe_ep::bench::MakeInputs;
using moe_ep::bench::NowUs;
using moe_ep::bench::Options;
using moe_ep::bench::Percentile;

#define CUDA_OR_DIE(call)                                              \
  do {                                                                 \
    cudaError_t e_ = (call);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      return 1;                                                        \
    }                                                                  \
  } while (0)

bool Ok(moe_ep_status s, const char* what) {
  if (s == MOE_EP_OK) return true;
  std::fprintf(stderr, "%s: status %d: %s\n", what, s, moe_ep_last_error());
  return false;
}

// The program; main() below only adds the last-resort catch.
int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"in-process moe_ep_forward against the Forward RPC (issue 16)"};
  app.add_option("--moe-ep", o.moe_ep, "the moe-ep CLI (forms the group)");
  std::string client = std::string(argv[0]);
  client = client.substr(0, client.rfind('/') + 1) + "moe_ep_forward_rpc_client";
  app.add_option("--rpc-client", client, "the RPC client program (bench/forward_rpc_client.cc)")
      ->capture_default_str();
  app.add_option("--json", o.json, "also write the JSON result here");
  app.add_option("--tokens", o.tokens)->capture_default_str();
  app.add_option("--hidden", o.hidden)->capture_default_str();
  app.add_option("--experts", o.experts)->capture_default_str();
  app.add_option("--top-k", o.top_k)->capture_default_str();
  app.add_option("--intermediate", o.intermediate)->capture_default_str();
  app.add_option("--warmup", o.warmup)->capture_default_str();
  app.add_option("--iterations", o.iterations)->capture_default_str();
  app.add_option("--seed", o.seed)->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const char* args[] = {"--listen=127.0.0.1:0", "--backend=nccl", "--device=0", "--log-level=warn"};
  moe_ep_worker* worker = nullptr;
  if (!Ok(moe_ep_worker_start(4, args, &worker), "moe_ep_worker_start")) return 1;
  const char* address = nullptr;
  if (!Ok(moe_ep_worker_address(worker, &address), "moe_ep_worker_address")) return 1;
  const std::string up = o.moe_ep + " up --targets " + address + " --backend nccl --hidden " +
                         std::to_string(o.hidden) + " --experts " + std::to_string(o.experts) +
                         " --top-k " + std::to_string(o.top_k) + " --capacity " +
                         std::to_string(o.tokens) + " --load-experts swiglu --intermediate " +
                         std::to_string(o.intermediate) + " > /dev/null";
  const double form0 = NowUs();
  if (std::system(up.c_str()) != 0) {
    std::fprintf(stderr, "%s failed\n", up.c_str());
    return 1;
  }
  if (!Ok(moe_ep_worker_wait_ready_for_steps(worker, MOE_EP_STEPS_WORKER_EXPERTS, 120000),
          "moe_ep_worker_wait_ready_for_steps")) {
    return 1;
  }
  const double form_s = (NowUs() - form0) / 1e6;

  const Inputs in = MakeInputs(o);
  CUDA_OR_DIE(cudaSetDevice(0));
  cudaStream_t stream = nullptr;
  CUDA_OR_DIE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *d_hidden = nullptr, *d_ids = nullptr, *d_weights = nullptr, *d_out = nullptr;
  CUDA_OR_DIE(cudaMalloc(&d_hidden, in.hidden.size() * 2));
  CUDA_OR_DIE(cudaMalloc(&d_out, in.hidden.size() * 2));
  CUDA_OR_DIE(cudaMalloc(&d_ids, in.ids.size() * 4));
  CUDA_OR_DIE(cudaMalloc(&d_weights, in.weights.size() * 4));
  CUDA_OR_DIE(cudaMemcpy(d_hidden, in.hidden.data(), in.hidden.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OR_DIE(cudaMemcpy(d_ids, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OR_DIE(
      cudaMemcpy(d_weights, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice));
  if (!Ok(moe_ep_commit_geometry(worker, 1, o.tokens, o.tokens), "commit_geometry")) return 1;

  std::vector<double> step_us, enqueue_us;
  for (int i = 0; i < o.warmup + o.iterations; ++i) {
    const double t0 = NowUs();
    if (!Ok(moe_ep_forward(worker, 0, static_cast<const uint16_t*>(d_hidden),
                           static_cast<const int32_t*>(d_ids), static_cast<const float*>(d_weights),
                           o.tokens, static_cast<uint16_t*>(d_out), stream, 0),
            "moe_ep_forward")) {
      return 1;
    }
    const double t1 = NowUs();
    CUDA_OR_DIE(cudaStreamSynchronize(stream));
    const double t2 = NowUs();
    if (i >= o.warmup) {
      enqueue_us.push_back(t1 - t0);
      step_us.push_back(t2 - t0);
    }
  }
  if (!Ok(moe_ep_check_step(worker, 0), "moe_ep_check_step")) return 1;
  std::vector<uint16_t> local(in.hidden.size());
  CUDA_OR_DIE(cudaMemcpy(local.data(), d_out, local.size() * 2, cudaMemcpyDeviceToHost));

  // The RPC client, in its own process.
  const std::string out_file = "/tmp/moe_ep_forward_bench_rpc.bin";
  std::vector<std::string> child = {client,
                                    "--address",
                                    address,
                                    "--output-file",
                                    out_file,
                                    "--tokens",
                                    std::to_string(o.tokens),
                                    "--hidden",
                                    std::to_string(o.hidden),
                                    "--experts",
                                    std::to_string(o.experts),
                                    "--top-k",
                                    std::to_string(o.top_k),
                                    "--warmup",
                                    std::to_string(o.warmup),
                                    "--iterations",
                                    std::to_string(o.iterations),
                                    "--seed",
                                    std::to_string(o.seed)};
  std::vector<char*> child_argv;
  child_argv.reserve(child.size() + 1);
  for (auto& a : child) child_argv.push_back(a.data());
  child_argv.push_back(nullptr);
  int pipe_fd[2];
  if (pipe(pipe_fd) != 0) return 1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fd[1], 1);
  posix_spawn_file_actions_addclose(&actions, pipe_fd[0]);
  pid_t pid = 0;
  if (posix_spawn(&pid, client.c_str(), &actions, nullptr, child_argv.data(), environ) != 0) {
    std::fprintf(stderr, "cannot start %s\n", client.c_str());
    return 1;
  }
  close(pipe_fd[1]);
  std::string text;
  char buf[256];
  ssize_t n;
  while ((n = read(pipe_fd[0], buf, sizeof(buf))) > 0) text.append(buf, n);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    std::fprintf(stderr, "the RPC client failed (%s)\n", text.c_str());
    return 1;
  }
  double rpc_p50 = 0, rpc_p99 = 0;
  long long rpc_total_us = 0;
  std::sscanf(text.c_str(), "%lf %lf %lld", &rpc_p50, &rpc_p99, &rpc_total_us);
  std::ifstream file(out_file, std::ios::binary);
  std::string remote((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const bool equal = remote.size() == local.size() * 2 &&
                     std::memcmp(remote.data(), local.data(), remote.size()) == 0;

  char json[1024];
  std::snprintf(json, sizeof(json),
                "{\"tokens\": %lld, \"hidden\": %lld, \"experts\": %d, \"top_k\": %d, "
                "\"intermediate\": %lld, \"ep\": 1, \"iterations\": %d, \"form_s\": %.1f, "
                "\"in_process_p50_us\": %.1f, \"in_process_p99_us\": %.1f, "
                "\"in_process_enqueue_p50_us\": %.1f, \"rpc_p50_us\": %.1f, "
                "\"rpc_p99_us\": %.1f, \"rpc_worker_total_us\": %lld, \"speedup_p50\": %.1f, "
                "\"outputs_bit_equal\": %s}",
                static_cast<long long>(o.tokens), static_cast<long long>(o.hidden), o.experts,
                o.top_k, static_cast<long long>(o.intermediate), o.iterations, form_s,
                Percentile(step_us, 0.5), Percentile(step_us, 0.99), Percentile(enqueue_us, 0.5),
                rpc_p50, rpc_p99, rpc_total_us, rpc_p50 / Percentile(step_us, 0.5),
                equal ? "true" : "false");
  std::printf("%s\n", json);
  if (!o.json.empty()) std::ofstream(o.json) << json << "\n";
  Ok(moe_ep_worker_stop(worker, 1000), "moe_ep_worker_stop");
  return equal ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "embedded_forward_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr,
                 "embedded_forward_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
