// The Forward RPC side of bench/embedded_forward_bench.cc (issue 16 item 5):
// sends the bench's seeded 4096-token layer (bench/forward_bench_inputs.h)
// to the worker at --address as one ForwardRequest (layer 0, epoch 1) over
// loopback gRPC, --warmup + --iterations times, writes the last output's
// bytes to --output-file and prints "p50_us p99_us worker_total_us".
// A program of its own: it links the protobuf stubs, libmoe_ep.so does not
// meet them here.

#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <exception>
#include <fstream>

#include "CLI/CLI.hpp"
#include "bench/forward_bench_inputs.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace {

using moe_ep::bench::Inputs;
using moe_ep::bench::MakeInputs;
using moe_ep::bench::NowUs;
using moe_ep::bench::Options;
using moe_ep::bench::Percentile;

void SetTensor(moe_ep::v1::Tensor* t, moe_ep::v1::DType dtype, const std::vector<int64_t>& shape,
               const void* data, size_t bytes) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(data, bytes);
}

int RunRpcClient(const Options& o) {
  const Inputs in = MakeInputs(o);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(o.address, grpc::InsecureChannelCredentials(), args);
  auto stub = moe_ep::v1::Worker::NewStub(channel);
  moe_ep::v1::ForwardRequest request;
  request.set_layer(0);
  request.set_epoch(1);
  SetTensor(request.mutable_hidden_states(), moe_ep::v1::DTYPE_BF16, {o.tokens, o.hidden},
            in.hidden.data(), in.hidden.size() * 2);
  SetTensor(request.mutable_topk_ids(), moe_ep::v1::DTYPE_INT32, {o.tokens, o.top_k}, in.ids.data(),
            in.ids.size() * 4);
  SetTensor(request.mutable_topk_weights(), moe_ep::v1::DTYPE_FP32, {o.tokens, o.top_k},
            in.weights.data(), in.weights.size() * 4);
  std::vector<double> us;
  moe_ep::v1::ForwardResponse response;
  for (int i = 0; i < o.warmup + o.iterations; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    response.Clear();
    const double t0 = NowUs();
    const grpc::Status status = stub->Forward(&context, request, &response);
    const double t1 = NowUs();
    if (!status.ok()) {
      std::fprintf(stderr, "Forward RPC: %d %s\n", status.error_code(),
                   status.error_message().c_str());
      return 1;
    }
    if (i >= o.warmup) us.push_back(t1 - t0);
  }
  std::ofstream(o.output_file, std::ios::binary) << response.output().data();
  std::printf("%.1f %.1f %lld\n", Percentile(us, 0.5), Percentile(us, 0.99),
              static_cast<long long>(response.timings().total_us()));
  return 0;
}

// The program; main() below only adds the last-resort catch.
int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"the Forward RPC side of moe_ep_embedded_forward_bench"};
  app.add_option("--address", o.address, "host:port of the worker")->required();
  app.add_option("--output-file", o.output_file, "the last output's bytes")->required();
  app.add_option("--tokens", o.tokens);
  app.add_option("--hidden", o.hidden);
  app.add_option("--experts", o.experts);
  app.add_option("--top-k", o.top_k);
  app.add_option("--warmup", o.warmup);
  app.add_option("--iterations", o.iterations);
  app.add_option("--seed", o.seed);
  CLI11_PARSE(app, argc, argv);
  return RunRpcClient(o);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forward_rpc_client: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "forward_rpc_client: error: an exception that is not a std::exception\n");
  }
  return 1;
}
