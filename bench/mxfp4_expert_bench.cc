// gpt-oss mxfp4 expert compute on one GPU (issue 35 item 4; DESIGN §10):
// ExpertCompute::Run on mxfp4 experts at gpt-oss-120b's shape (128 experts,
// H 2880, I 2880, top-4) against the weight-streaming bound, the bytes of the
// experts that got rows (blocks + scales + biases) over --bound-tbps (the
// H200's 4.8 TB/s), and the device's measured copy rate in the same run.
// The weights are random e2m1 codes with E8M0 scales 118..122 (finite; the
// time does not depend on the values), one expert's bytes copied to every
// slot; the step runs from a CUDA graph (it is capturable) and the p50 of
// --iters replays is reported, then the two GEMMs alone (gate_up + GLU, then
// down, one graph, on the routing's per-expert row counts) with each
// prefetch depth of --prefetch, activations in the register ring or not
// (--ring-x 1 -1); one CSV row per token count:
//   tokens,rows,experts_hit,H,I,topk,step_p50_us,weight_bound_us,
//   step_vs_weight_bound,weight_tbps,copy_tbps,nonfinite,
//   gemms_p50_us_prefetch<d>_x<r>... (one column per depth and ring choice)
// then, per --pairs entry (glu/down variants, each depth:min_ctas_per_sm
// [:pair_chunks] of Mxfp4GemmParams, 0 the default), both GEMMs with those,
// and per --variants entry each GEMM alone with it:
//   gemms_p50_us_<pair>..., glu_us_<variant>,down_us_<variant>...
// Usage: moe_ep_mxfp4_bench [--tokens 1 128 4096] [--iters 100].

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "bench/expert_bench_util.h"
#include "core/bf16.h"
#include "core/quantized_formats.h"
#include "kernels/device_experts.h"
#include "kernels/dispatch_pack.cuh"
#include "kernels/expert_compute.h"
#include "kernels/mxfp4_grouped_gemm.cuh"

namespace moe_ep::kernels {
namespace {

int Main(int argc, char** argv) {
  CLI::App app{"moe-ep gpt-oss mxfp4 expert compute against its weight-streaming bound"};
  std::vector<int64_t> token_list = {1, 128, 4096};
  int num_experts = 128;
  int top_k = 4;
  int warmup = 10;
  int iters = 100;
  int64_t hidden = 2880;
  int64_t inter = 2880;
  double bound_tbps = 4.8;
  app.add_option("--tokens", token_list, "token counts");
  app.add_option("--experts", num_experts, "local experts (EP 1: all)");
  app.add_option("--topk", top_k);
  app.add_option("--hidden", hidden, "H, a multiple of 64");
  app.add_option("--intermediate", inter, "I, a multiple of 64");
  app.add_option("--warmup", warmup);
  app.add_option("--iters", iters);
  app.add_option("--bound-tbps", bound_tbps, "memory rate of the weight bound (TB/s)");
  std::vector<int> prefetch = {3, 6};
  app.add_option("--prefetch", prefetch, "prefetch depths of the GEMMs-alone timings");
  std::vector<int> ring_x = {1};
  app.add_option("--ring-x", ring_x, "activations in the ring (1) or loaded at use (-1)");
  std::vector<std::string> variants;
  app.add_option("--variants", variants,
                 "depth:min_ctas_per_sm[:pair_chunks]; each GEMM is timed alone with each (0:0 "
                 "the default)");
  std::vector<std::string> pairs;
  app.add_option("--pairs", pairs,
                 "glu_depth:glu_min_ctas/down_depth:down_min_ctas; both GEMMs are timed with each");
  CLI11_PARSE(app, argc, argv);
  // depth:min_ctas[:pair_chunks]
  auto parse = [](const std::string& v) {
    std::vector<int> f;
    size_t from = 0;
    for (size_t colon; (colon = v.find(':', from)) != std::string::npos; from = colon + 1) {
      f.push_back(std::stoi(v.substr(from, colon - from)));
    }
    f.push_back(std::stoi(v.substr(from)));
    if (f.size() < 2 || f.size() > 3) {
      throw std::invalid_argument("expected depth:min_ctas[:pair_chunks]: " + v);
    }
    return std::array<int, 3>{f[0], f[1], f.size() == 3 ? f[2] : 0};
  };
  std::vector<std::array<int, 3>> kernel_variants;
  kernel_variants.reserve(variants.size());
  for (const std::string& v : variants) kernel_variants.push_back(parse(v));
  std::vector<std::pair<std::array<int, 3>, std::array<int, 3>>> variant_pairs;
  for (const std::string& v : pairs) {
    const size_t slash = v.find('/');
    if (slash == std::string::npos) throw std::invalid_argument("expected glu/down: " + v);
    variant_pairs.emplace_back(parse(v.substr(0, slash)), parse(v.substr(slash + 1)));
  }

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Device-to-device copy rate (read + write), the same process.
  const double copy_tbps = bench::CopyTbps(stream);

  // One random expert's six arrays, copied to every slot.
  const int64_t gu_blocks = 2 * inter * hidden / 2;
  const int64_t dn_blocks = hidden * inter / 2;
  const int64_t gu_scales = 2 * inter * hidden / core::quant::kMxfp4Block;
  const int64_t dn_scales = hidden * inter / core::quant::kMxfp4Block;
  const int64_t expert_bytes =
      gu_blocks + dn_blocks + gu_scales + dn_scales + 2 * (2 * inter + hidden);
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> exponent(118, 122);
  std::uniform_real_distribution<float> v(-0.05f, 0.05f);
  std::vector<uint8_t> host_blocks(gu_blocks + dn_blocks);
  std::vector<uint8_t> host_scales(gu_scales + dn_scales);
  std::vector<uint16_t> host_bias(2 * inter + hidden);
  for (uint8_t& b : host_blocks) b = static_cast<uint8_t>(byte(rng));
  Mxfp4BlocksToDeviceOrder(host_blocks.data(), static_cast<int64_t>(host_blocks.size()));
  for (uint8_t& s : host_scales) s = static_cast<uint8_t>(exponent(rng));
  for (uint16_t& b : host_bias) b = core::FloatToBf16(v(rng));
  uint8_t* blocks = nullptr;
  uint8_t* scales = nullptr;
  uint16_t* bias = nullptr;
  int32_t* slots = nullptr;
  const int64_t e = num_experts;
  CUDA_CHECK(cudaMalloc(&blocks, e * (gu_blocks + dn_blocks)));
  CUDA_CHECK(cudaMalloc(&scales, e * (gu_scales + dn_scales)));
  CUDA_CHECK(cudaMalloc(&bias, e * (2 * inter + hidden) * 2));
  CUDA_CHECK(cudaMalloc(&slots, e * 4));
  std::vector<int32_t> slot_ids(num_experts);
  for (int l = 0; l < num_experts; ++l) {
    slot_ids[l] = l;
    CUDA_CHECK(
        cudaMemcpy(blocks + l * gu_blocks, host_blocks.data(), gu_blocks, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(blocks + e * gu_blocks + l * dn_blocks, host_blocks.data() + gu_blocks,
                          dn_blocks, cudaMemcpyHostToDevice));
    CUDA_CHECK(
        cudaMemcpy(scales + l * gu_scales, host_scales.data(), gu_scales, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(scales + e * gu_scales + l * dn_scales, host_scales.data() + gu_scales,
                          dn_scales, cudaMemcpyHostToDevice));
    CUDA_CHECK(
        cudaMemcpy(bias + l * 2 * inter, host_bias.data(), 2 * inter * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(bias + e * 2 * inter + l * hidden, host_bias.data() + 2 * inter,
                          hidden * 2, cudaMemcpyHostToDevice));
  }
  CUDA_CHECK(cudaMemcpy(slots, slot_ids.data(), e * 4, cudaMemcpyHostToDevice));
  Mxfp4Experts experts;
  experts.slot_ids = slots;
  experts.num_experts = num_experts;
  experts.hidden = hidden;
  experts.intermediate = inter;
  experts.gate_up_blocks = blocks;
  experts.down_blocks = blocks + e * gu_blocks;
  experts.gate_up_scales = scales;
  experts.down_scales = scales + e * gu_scales;
  experts.gate_up_bias = bias;
  experts.down_bias = bias + e * 2 * inter;

  const int64_t max_tokens = *std::max_element(token_list.begin(), token_list.end());
  auto ec = ExpertCompute::Create(max_tokens, top_k, hidden, inter, num_experts);
  BENCH_CHECK(ec.status());
  const int64_t row_bytes = DispatchRowBytes(hidden, top_k);
  uint8_t* recv = nullptr;
  uint16_t* out = nullptr;
  CUDA_CHECK(cudaMalloc(&recv, max_tokens * row_bytes));
  CUDA_CHECK(cudaMalloc(&out, max_tokens * hidden * 2));
  std::printf(
      "tokens,rows,experts_hit,H,I,topk,step_p50_us,weight_bound_us,step_vs_weight_bound,"
      "weight_tbps,copy_tbps,nonfinite");
  for (const int d : prefetch) {
    for (const int r : ring_x) std::printf(",gemms_p50_us_prefetch%d_x%d", d, r);
  }
  for (const std::string& v : pairs) std::printf(",gemms_p50_us_%s", v.c_str());
  for (const std::string& v : variants) std::printf(",glu_us_%s,down_us_%s", v.c_str(), v.c_str());
  std::printf("\n");
  // The GEMMs-alone operands: random bf16 rows (x [rows, H], act [rows, I]).
  const int64_t max_rows = max_tokens * top_k;
  std::vector<uint16_t> host_a(max_rows * std::max(hidden, inter));
  for (uint16_t& x : host_a) x = core::FloatToBf16(v(rng) * 20.0f);
  uint16_t* gemm_a = nullptr;
  uint16_t* gemm_act = nullptr;
  float* gemm_y = nullptr;
  int32_t* gemm_offsets = nullptr;
  CUDA_CHECK(cudaMalloc(&gemm_a, host_a.size() * 2));
  CUDA_CHECK(cudaMalloc(&gemm_act, max_rows * inter * 2));
  CUDA_CHECK(cudaMalloc(&gemm_y, max_rows * hidden * 4));
  CUDA_CHECK(cudaMalloc(&gemm_offsets, (e + 1) * 4));
  CUDA_CHECK(cudaMemcpy(gemm_a, host_a.data(), host_a.size() * 2, cudaMemcpyHostToDevice));
  for (const int64_t tokens : token_list) {
    std::set<int> hit;
    const std::vector<uint8_t> host =
        bench::MakeRecvRows(rng, tokens, hidden, top_k, num_experts, row_bytes, &hit);
    CUDA_CHECK(cudaMemcpy(recv, host.data(), host.size(), cudaMemcpyHostToDevice));
    auto run = [&] { BENCH_CHECK((*ec)->RunMxfp4(recv, tokens, experts, out, stream)); };
    run();  // module load and attributes outside the capture
    CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    run();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const double step_us =
        bench::TimeP50(stream, warmup, iters, [&] { CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    std::vector<uint16_t> result(tokens * hidden);
    CUDA_CHECK(cudaMemcpy(result.data(), out, result.size() * 2, cudaMemcpyDeviceToHost));
    int64_t nonfinite = 0;
    for (uint16_t x : result) nonfinite += std::isfinite(core::Bf16ToFloat(x)) ? 0 : 1;
    const double bytes = static_cast<double>(hit.size()) * static_cast<double>(expert_bytes);
    const double bound_us = bytes / (bound_tbps * 1e12) * 1e6;
    // The GEMMs alone on the routing's per-expert counts, contiguous.
    std::vector<int32_t> offsets(num_experts + 1, 0);
    for (int64_t t = 0; t < tokens; ++t) {
      const auto* ids = reinterpret_cast<const int32_t*>(host.data() + t * row_bytes + 2 * hidden);
      for (int k = 0; k < top_k; ++k) ++offsets[ids[k] + 1];
    }
    for (int x = 0; x < num_experts; ++x) offsets[x + 1] += offsets[x];
    CUDA_CHECK(
        cudaMemcpy(gemm_offsets, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
    std::vector<double> gemms_us;
    std::vector<std::pair<int, int>> configs;
    for (const int depth : prefetch) {
      for (const int r : ring_x) configs.emplace_back(depth, r);
    }
    auto params = [&](int depth, int ring, const std::array<int, 3>& variant,
                      Mxfp4GemmParams* gate_up, Mxfp4GemmParams* down) {
      gate_up->a = gemm_a;
      gate_up->max_rows = tokens * top_k;
      gate_up->blocks = experts.gate_up_blocks;
      gate_up->scales = experts.gate_up_scales;
      gate_up->bias = experts.gate_up_bias;
      gate_up->offsets = gemm_offsets;
      gate_up->num_local_experts = num_experts;
      gate_up->n = inter;
      gate_up->k = hidden;
      gate_up->prefetch_steps = depth != 0 ? depth : variant[0];
      gate_up->ring_activations = ring;
      gate_up->min_ctas_per_sm = variant[1];
      gate_up->pair_chunks = variant[2];
      *down = *gate_up;
      down->a = gemm_act;
      down->blocks = experts.down_blocks;
      down->scales = experts.down_scales;
      down->bias = experts.down_bias;
      down->n = hidden;
      down->k = inter;
    };
    auto time_graph = [&](const auto& body) {
      body();
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      body();
      CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const double us =
          bench::TimeP50(stream, warmup, iters, [&] { CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      return us;
    };
    std::vector<double> alone_us;
    for (const std::array<int, 3>& variant : kernel_variants) {
      Mxfp4GemmParams gate_up;
      Mxfp4GemmParams down;
      params(0, 0, variant, &gate_up, &down);
      alone_us.push_back(time_graph([&] {
        BENCH_CHECK(LaunchMxfp4GroupedGptOssGlu(gate_up, 1.702f, 7.0f, gemm_act, stream));
      }));
      alone_us.push_back(
          time_graph([&] { BENCH_CHECK(LaunchMxfp4GroupedGemm(down, gemm_y, stream)); }));
    }
    for (const auto& [depth, ring] : configs) {
      Mxfp4GemmParams gate_up;
      Mxfp4GemmParams down;
      params(depth, ring, {0, 0, 0}, &gate_up, &down);
      gemms_us.push_back(time_graph([&] {
        BENCH_CHECK(LaunchMxfp4GroupedGptOssGlu(gate_up, 1.702f, 7.0f, gemm_act, stream));
        BENCH_CHECK(LaunchMxfp4GroupedGemm(down, gemm_y, stream));
      }));
    }
    // Both GEMMs, each with its own variant.
    for (const auto& [glu_variant, down_variant] : variant_pairs) {
      Mxfp4GemmParams gate_up;
      Mxfp4GemmParams down;
      Mxfp4GemmParams unused;
      params(0, 0, glu_variant, &gate_up, &unused);
      params(0, 0, down_variant, &unused, &down);
      gemms_us.push_back(time_graph([&] {
        BENCH_CHECK(LaunchMxfp4GroupedGptOssGlu(gate_up, 1.702f, 7.0f, gemm_act, stream));
        BENCH_CHECK(LaunchMxfp4GroupedGemm(down, gemm_y, stream));
      }));
    }
    std::printf("%lld,%lld,%zu,%lld,%lld,%d,%.1f,%.1f,%.2f,%.2f,%.2f,%lld",
                static_cast<long long>(tokens), static_cast<long long>(tokens) * top_k, hit.size(),
                static_cast<long long>(hidden), static_cast<long long>(inter), top_k, step_us,
                bound_us, step_us / bound_us, bytes / (step_us * 1e-6) / 1e12, copy_tbps,
                static_cast<long long>(nonfinite));
    for (const double us : gemms_us) std::printf(",%.1f", us);
    for (const double us : alone_us) std::printf(",%.1f", us);
    std::printf("\n");
    std::fflush(stdout);
  }
  cudaFree(blocks);
  cudaFree(scales);
  cudaFree(bias);
  cudaFree(slots);
  cudaFree(recv);
  cudaFree(out);
  cudaFree(gemm_a);
  cudaFree(gemm_act);
  cudaFree(gemm_y);
  cudaFree(gemm_offsets);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace
}  // namespace moe_ep::kernels

int main(int argc, char** argv) {
  try {
    return moe_ep::kernels::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mxfp4_expert_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "mxfp4_expert_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
