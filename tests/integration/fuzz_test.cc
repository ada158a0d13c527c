// A hostile client against real moe-ep-worker processes on loopback (issue
// 13): valid requests of every Worker and Rendezvous RPC, mutated field by
// field (protobuf reflection: boundary numbers, long strings, huge shapes)
// and byte by byte (flips, cuts, insertions, random bytes), sent as raw
// bytes through a generic stub. After every call it asserts:
//   - the worker answered before the call's deadline plus a slack (no hang);
//   - the code is one the RPC documents in proto/moe_ep/v1/*.proto (or
//     INTERNAL for bytes that do not parse as the request);
//   - a rejected call changed nothing GetStatus shows (counters.errors aside:
//     the snapshot after the call against the one after the previous call),
//     except one that the client's deadline cut off: that DEADLINE_EXCEEDED
//     does not say whether the server finished (gRPC's semantics), so after
//     one the harness waits until GetStatus settles before the next call;
//   - the worker still answers (no crash), and at the end its process runs.
// Each worker is its own group of one (every collective completes on it) with
// one client thread, so calls reach the handlers at loopback speed; after an
// accepted call moved the worker it is set up again (ALLOCATED, geometry
// epoch 1). MOE_EP_FUZZ_REQUESTS (default 20000), MOE_EP_FUZZ_WORKERS
// (default 4), MOE_EP_FUZZ_SECONDS (a time budget) and MOE_EP_FUZZ_SEED set
// the run; it prints the rate, the CPU per request and where the client
// threads' time went. The long runs of bench/results/fuzz.md and
// bench/results/fuzz-long/ used this test.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/local_cluster.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"
#include "google/protobuf/stubs/common.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/rendezvous.grpc.pb.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::testing {
namespace {

namespace v1 = ::moe_ep::v1;
namespace pb = ::google::protobuf;
using grpc::StatusCode;

constexpr auto kDeadline = std::chrono::milliseconds(1500);
constexpr auto kSlack = std::chrono::milliseconds(3000);
// A DEADLINE_EXCEEDED that arrives this much before kDeadline was the
// server's own answer, not the client giving up.
constexpr auto kServerMargin = std::chrono::milliseconds(200);

// User + system CPU seconds of process `pid` so far (/proc/PID/stat), or 0
// when it cannot be read.
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start past ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::atof(field.c_str());  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value == nullptr ? fallback : std::atoll(value);
}

// One RPC: its method path, a valid request and the codes it documents.
struct Rpc {
  std::string method;
  std::unique_ptr<pb::Message> valid;
  std::set<StatusCode> codes;
};

std::vector<Rpc> MakeRpcs() {
  // The codes every Worker RPC may return (worker.proto, "Codes").
  const std::set<StatusCode> common = {StatusCode::OK,
                                       StatusCode::UNAVAILABLE,
                                       StatusCode::DEADLINE_EXCEEDED,
                                       StatusCode::CANCELLED,
                                       StatusCode::RESOURCE_EXHAUSTED,
                                       StatusCode::INVALID_ARGUMENT,
                                       StatusCode::FAILED_PRECONDITION};
  auto with = [&](const std::set<StatusCode>& extra) {
    std::set<StatusCode> all = common;
    all.insert(extra.begin(), extra.end());
    return all;
  };
  const std::set<StatusCode> collective = {StatusCode::ABORTED};
  std::vector<Rpc> rpcs;
  auto add = [&](const std::string& method, pb::Message* valid, std::set<StatusCode> codes) {
    rpcs.push_back(Rpc{method, std::unique_ptr<pb::Message>(valid), std::move(codes)});
  };
  add("/moe_ep.v1.Worker/GetStatus", new v1::GetStatusRequest, with({}));
  auto* join = new v1::JoinRequest;
  join->set_world_size(1);
  join->set_backend("gloo");
  join->set_generation(1000);
  join->set_timeout_ms(1000);
  add("/moe_ep.v1.Worker/Join", join, with({StatusCode::ABORTED}));
  add("/moe_ep.v1.Worker/Leave", new v1::LeaveRequest, with({}));
  auto* configure = new v1::ConfigureLayersRequest;
  configure->mutable_layout()->set_tp_size(1);
  configure->mutable_layout()->set_attn_dp_size(1);
  configure->set_a2a_enabled(true);
  v1::ModelDescription* model = configure->mutable_model();
  model->set_name("fuzz");
  model->set_hidden_size(8);
  model->set_num_layers(2);
  model->set_num_experts(4);
  model->set_top_k(2);
  model->set_moe_intermediate_size(8);
  model->add_sparse_layers(true);
  model->add_sparse_layers(false);
  add("/moe_ep.v1.Worker/ConfigureLayers", configure, with(collective));
  auto* allocate = new v1::AllocateWorkspaceRequest;
  allocate->set_hidden_size(8);
  allocate->set_top_k(2);
  allocate->set_num_experts(4);
  allocate->set_capacity_tokens(16);
  allocate->add_cuda_graph_buckets(4);
  allocate->add_cuda_graph_buckets(16);
  allocate->set_redundant_slots_per_rank(1);  // room for InstallPlacement's replica
  add("/moe_ep.v1.Worker/AllocateWorkspace", allocate, with(collective));
  auto* load = new v1::LoadExpertsRequest;
  load->set_layer(0);
  load->set_kind(v1::EXPERT_KIND_SWIGLU);
  load->set_seed(3);
  load->set_intermediate_size(8);
  load->set_name_pattern("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight");
  add("/moe_ep.v1.Worker/LoadExperts", load,
      with({StatusCode::PERMISSION_DENIED, StatusCode::NOT_FOUND, StatusCode::DATA_LOSS,
            StatusCode::INTERNAL}));
  // DESIGN §15: 4 experts on 5 slots (one replica of expert 2).
  auto* placement = new v1::InstallPlacementRequest;
  placement->set_layer(0);
  v1::PlacementRank* rank0 = placement->add_ranks();
  for (int e : {0, 1, 2, 3, 2}) rank0->add_slot_experts(e);
  add("/moe_ep.v1.Worker/InstallPlacement", placement, with(collective));
  auto* load_stats = new v1::GetExpertLoadRequest;
  load_stats->set_layer(0);
  load_stats->set_reset(true);
  add("/moe_ep.v1.Worker/GetExpertLoad", load_stats, with({}));
  auto* sync = new v1::SyncTokenCountsRequest;
  sync->set_epoch(1);
  sync->set_local_tokens(3);
  add("/moe_ep.v1.Worker/SyncTokenCounts", sync, with(collective));
  auto* commit = new v1::CommitGeometryRequest;
  commit->set_epoch(1);
  commit->set_runtime_max_tokens_per_rank(4);
  commit->set_local_tokens(3);
  add("/moe_ep.v1.Worker/CommitGeometry", commit, with({}));
  auto* forward = new v1::ForwardRequest;
  forward->set_layer(0);
  forward->set_epoch(1);
  v1::Tensor* hidden = forward->mutable_hidden_states();
  hidden->set_dtype(v1::DTYPE_BF16);
  hidden->add_shape(3);
  hidden->add_shape(8);
  hidden->set_data(std::string(3 * 8 * 2, '\x3f'));
  v1::Tensor* ids = forward->mutable_topk_ids();
  ids->set_dtype(v1::DTYPE_INT32);
  ids->add_shape(3);
  ids->add_shape(2);
  const int32_t id_values[6] = {0, 1, 2, 3, 1, -1};
  ids->set_data(reinterpret_cast<const char*>(id_values), sizeof(id_values));
  v1::Tensor* weights = forward->mutable_topk_weights();
  weights->set_dtype(v1::DTYPE_FP32);
  weights->add_shape(3);
  weights->add_shape(2);
  const float weight_values[6] = {0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f};
  weights->set_data(reinterpret_cast<const char*>(weight_values), sizeof(weight_values));
  add("/moe_ep.v1.Worker/Forward", forward, with(collective));
  auto* bench = new v1::BenchmarkRequest;
  bench->set_tokens_per_rank(4);
  bench->set_hidden_size(8);
  bench->set_top_k(2);
  bench->set_num_experts(4);
  bench->set_routing("skewed");
  bench->set_iterations(2);
  bench->set_warmup(1);
  add("/moe_ep.v1.Worker/Benchmark", bench, with(collective));
  auto* layers = new v1::ForwardLayersRequest;
  layers->set_epoch(1);
  layers->mutable_stack()->set_num_layers(2);
  layers->mutable_stack()->set_dense_intermediate_size(8);
  v1::Tensor* tokens = layers->mutable_tokens();
  tokens->set_dtype(v1::DTYPE_FP32);
  tokens->add_shape(2);
  tokens->add_shape(8);
  tokens->set_data(std::string(2 * 8 * 4, '\0'));
  add("/moe_ep.v1.Worker/ForwardLayers", layers,
      with({StatusCode::ABORTED, StatusCode::UNIMPLEMENTED}));
  auto* rejoin = new v1::RejoinRequest;
  rejoin->set_generation(1000);
  rejoin->set_mask_round(1);
  rejoin->add_masked_ranks(1);
  rejoin->add_ranks(1);
  add("/moe_ep.v1.Worker/Rejoin", rejoin, with({StatusCode::ABORTED, StatusCode::UNIMPLEMENTED}));
  auto* lease = new v1::LeaseRequest;
  lease->mutable_claim()->set_owner_id("fuzz");
  lease->mutable_claim()->set_ttl_ms(1000);
  add("/moe_ep.v1.Worker/Lease", lease, with({}));
  // Rendezvous (rendezvous.proto).
  const std::set<StatusCode> store = {StatusCode::OK,
                                      StatusCode::INVALID_ARGUMENT,
                                      StatusCode::ALREADY_EXISTS,
                                      StatusCode::RESOURCE_EXHAUSTED,
                                      StatusCode::UNAVAILABLE,
                                      StatusCode::FAILED_PRECONDITION,
                                      StatusCode::PERMISSION_DENIED,
                                      StatusCode::DEADLINE_EXCEEDED,
                                      StatusCode::CANCELLED};
  auto* set = new v1::SetRequest;
  set->set_key("gen1000/fuzz");
  set->set_value("value");
  add("/moe_ep.v1.Rendezvous/Set", set, store);
  auto* get = new v1::GetRequest;
  get->set_key("gen1000/fuzz");
  get->set_timeout_ms(10);
  add("/moe_ep.v1.Rendezvous/Get", get, store);
  auto* wait = new v1::WaitRequest;
  wait->add_keys("gen1000/a");
  wait->add_keys("gen1000/b");
  wait->set_timeout_ms(10);
  add("/moe_ep.v1.Rendezvous/Wait", wait, store);
  return rpcs;
}

// Field-level mutations through reflection.
class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string Mutate(const pb::Message& valid) {
    std::unique_ptr<pb::Message> message(valid.New());
    message->CopyFrom(valid);
    const int field_edits = Pick(4);
    for (int i = 0; i < field_edits; ++i) MutateField(message.get(), 0);
    std::string bytes = message->SerializeAsString();
    switch (Pick(6)) {
      case 0:  // bytes as they are
      case 1:
        break;
      case 2:
        FlipBytes(&bytes);
        break;
      case 3:
        if (!bytes.empty()) bytes.resize(Pick(bytes.size()));
        break;
      case 4:
        bytes.insert(Pick(bytes.size() + 1), RandomBytes(1 + Pick(16)));
        break;
      default:
        bytes = RandomBytes(Pick(64));
        break;
    }
    return bytes;
  }

 private:
  size_t Pick(size_t n) {
    return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_);
  }

  int64_t Interesting() {
    static const int64_t values[] = {0,
                                     1,
                                     -1,
                                     2,
                                     3,
                                     7,
                                     8,
                                     1000,
                                     1001,
                                     65536,
                                     int64_t{1} << 31,
                                     std::numeric_limits<int32_t>::max(),
                                     std::numeric_limits<int32_t>::min(),
                                     std::numeric_limits<int64_t>::max(),
                                     std::numeric_limits<int64_t>::min(),
                                     int64_t{1} << 53,
                                     (int64_t{1} << 53) + 1};
    if (Pick(4) == 0) return static_cast<int64_t>(rng_());
    return values[Pick(sizeof(values) / sizeof(values[0]))];
  }

  std::string RandomBytes(size_t n) {
    std::string out(n, '\0');
    for (char& c : out) c = static_cast<char>(rng_());
    return out;
  }

  void FlipBytes(std::string* bytes) {
    if (bytes->empty()) return;
    const int flips = 1 + Pick(4);
    for (int i = 0; i < flips; ++i)
      (*bytes)[Pick(bytes->size())] ^= static_cast<char>(1 << Pick(8));
  }

  std::string InterestingString() {
    static const char* values[] = {"",
                                   "gloo",
                                   "nccl",
                                   "auto",
                                   "x",
                                   "uniform",
                                   "skewed",
                                   "127.0.0.1:1",
                                   "/etc/passwd",
                                   "/dev/zero",
                                   "/tmp",
                                   "gen1000/",
                                   "{layer}{expert}{proj}",
                                   "\xff\xfe"};
    switch (Pick(4)) {
      case 0:
        return std::string(1 + Pick(20000), static_cast<char>('a' + Pick(26)));
      case 1:
        return RandomBytes(Pick(32));
      default:
        return values[Pick(sizeof(values) / sizeof(values[0]))];
    }
  }

  void MutateField(pb::Message* message, int depth) {
    const pb::Descriptor* descriptor = message->GetDescriptor();
    if (descriptor->field_count() == 0) return;
    const pb::FieldDescriptor* field = descriptor->field(Pick(descriptor->field_count()));
    const pb::Reflection* r = message->GetReflection();
    if (field->is_repeated()) {
      if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) return;
      const int action = Pick(3);
      if (action == 0) {
        r->ClearField(message, field);
        return;
      }
      const int adds = action == 1 ? 1 : static_cast<int>(Pick(3000));
      for (int i = 0; i < adds; ++i) AddRepeated(message, field, r);
      return;
    }
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32:
        r->SetInt32(message, field, static_cast<int32_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT64:
        r->SetInt64(message, field, Interesting());
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT32:
        r->SetUInt32(message, field, static_cast<uint32_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(message, field, static_cast<uint64_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(message, field, Pick(2) == 1);
        break;
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        r->SetFloat(message, field, Pick(2) ? -1.0f : std::numeric_limits<float>::infinity());
        break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        r->SetDouble(message, field, -1.0);
        break;
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        r->SetEnumValue(message, field, static_cast<int>(Interesting() % 8));
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        r->SetString(message, field, InterestingString());
        break;
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        if (depth < 3) MutateField(r->MutableMessage(message, field), depth + 1);
        break;
    }
  }

  void AddRepeated(pb::Message* message, const pb::FieldDescriptor* field,
                   const pb::Reflection* r) {
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT64:
        r->AddInt64(message, field, Pick(2) ? Interesting() : static_cast<int64_t>(Pick(64)));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT32:
        r->AddInt32(message, field, static_cast<int32_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        r->AddBool(message, field, Pick(2) == 1);
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        r->AddString(message, field,
                     Pick(8) ? "gen1000/k" + std::to_string(Pick(100000)) : InterestingString());
        break;
      default:
        break;
    }
  }

  std::mt19937_64 rng_;
};

// One worker under fuzz: raw calls, a GetStatus snapshot, and a set-up that
// brings it back to ALLOCATED (generation above any it saw) after an accepted
// call moved it.
class Target {
 public:
  explicit Target(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        generic_(channel_),
        worker_(v1::Worker::NewStub(channel_)) {}

  grpc::Status Raw(const std::string& method, const std::string& bytes,
                   std::chrono::milliseconds* took) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext context;
    const auto start = std::chrono::steady_clock::now();
    context.set_deadline(std::chrono::system_clock::now() + kDeadline);
    grpc::Status status;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    generic_.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                       [&](grpc::Status s) {
                         std::lock_guard<std::mutex> lock(mu);
                         status = std::move(s);
                         done = true;
                         cv.notify_one();
                       });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    *took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                  start);
    return status;
  }

  // GetStatus without the counters a call may bump and the lease's time
  // left (it runs down between two snapshots).
  bool Snapshot(v1::GetStatusResponse* status) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!worker_->GetStatus(&context, v1::GetStatusRequest(), status).ok()) return false;
    status->mutable_counters()->set_errors(0);
    status->set_lease_remaining_ms(0);
    return true;
  }

  // A call that takes this worker's collective slot and is then refused
  // (SyncTokenCounts with local_tokens -1: INVALID_ARGUMENT, or
  // FAILED_PRECONDITION outside a group), changing nothing; it returns only
  // after whatever held the slot released it.
  grpc::Status SlotBarrier() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SyncTokenCountsRequest request;
    request.set_epoch(1);
    request.set_local_tokens(-1);
    v1::SyncTokenCountsResponse response;
    return worker_->SyncTokenCounts(&context, request, &response);
  }

  // Gives back a lease an accepted mutated call took (its owner id is in
  // GetStatus), so later unclaimed calls reach their own checks.
  bool ReleaseLease(const std::string& owner) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::LeaseRequest request;
    request.mutable_claim()->set_owner_id(owner);
    request.set_release(true);
    v1::LeaseResponse response;
    return worker_->Lease(&context, request, &response).ok();
  }

  // Join (a fresh generation), ConfigureLayers, AllocateWorkspace,
  // LoadExperts, SyncTokenCounts, CommitGeometry of the valid requests (looked
  // up by name: an RPC added to MakeRpcs must not shift the steps), then
  // checks that the worker is ALLOCATED at geometry epoch 1 and leaves that
  // snapshot in `*status`.
  bool SetUp(const std::vector<Rpc>& rpcs, v1::GetStatusResponse* status) {
    if (!Snapshot(status)) return false;
    v1::JoinRequest join = static_cast<const v1::JoinRequest&>(Valid(rpcs, "Worker/Join"));
    join.set_generation(std::max(status->generation(), status->max_generation_seen()) + 1);
    const std::vector<std::pair<std::string, const pb::Message*>> steps = {
        {"Worker/Join", &join},
        {"Worker/ConfigureLayers", &Valid(rpcs, "Worker/ConfigureLayers")},
        {"Worker/AllocateWorkspace", &Valid(rpcs, "Worker/AllocateWorkspace")},
        {"Worker/LoadExperts", &Valid(rpcs, "Worker/LoadExperts")},
        {"Worker/SyncTokenCounts", &Valid(rpcs, "Worker/SyncTokenCounts")},
        {"Worker/CommitGeometry", &Valid(rpcs, "Worker/CommitGeometry")}};
    for (const auto& [name, request] : steps) {
      std::chrono::milliseconds took;
      const grpc::Status s = Raw("/moe_ep.v1." + name, request->SerializeAsString(), &took);
      if (!s.ok()) {
        ADD_FAILURE() << "set-up " << name << ": " << s.error_message();
        return false;
      }
    }
    if (!Snapshot(status)) return false;
    if (status->state() != v1::WORKER_STATE_ALLOCATED || status->world_size() != 1 ||
        status->geometry_epoch() != 1) {
      ADD_FAILURE() << "set-up left the worker at {" << status->ShortDebugString()
                    << "}, not ALLOCATED at geometry epoch 1";
      return false;
    }
    return true;
  }

  // The valid request of the RPC whose method ends in `name`.
  static const pb::Message& Valid(const std::vector<Rpc>& rpcs, const std::string& name) {
    for (const Rpc& rpc : rpcs) {
      if (rpc.method.size() >= name.size() &&
          rpc.method.compare(rpc.method.size() - name.size(), name.size(), name) == 0) {
        return *rpc.valid;
      }
    }
    ADD_FAILURE() << "no RPC " << name;
    return *rpcs.front().valid;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub generic_;
  std::unique_ptr<v1::Worker::Stub> worker_;
};

struct Findings {
  int64_t calls = 0;
  std::map<std::string, int64_t> codes;  // "method code" -> count
  std::vector<std::string> failures;
  // Where the client thread's wall time went, in ms ("call <method>",
  // "snapshot", "settle", "set-up"), and how often.
  std::map<std::string, double> wall_ms;
  std::map<std::string, int64_t> counts;
};

// Adds the time since `start` to out->wall_ms[what].
void Charge(Findings* out, const std::string& what, std::chrono::steady_clock::time_point start) {
  out->wall_ms[what] +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ++out->counts[what];
}

// Fuzzes one worker with `requests` calls, or until `stop_at` if sooner.
void Fuzz(const std::string& address, uint64_t seed, int64_t requests, absl::Time stop_at,
          Findings* out) {
  const std::vector<Rpc> rpcs = MakeRpcs();
  Target target(address);
  // The worker's state before each call: the snapshot taken after the
  // previous call (or set-up). Nothing else talks to this worker, so it is
  // what a fresh GetStatus would show, at half the calls.
  v1::GetStatusResponse before;
  if (!target.SetUp(rpcs, &before)) {
    out->failures.push_back("initial set-up failed");
    return;
  }
  Mutator mutator(seed);
  std::mt19937_64 rng(seed ^ 0x5DEECE66Dull);
  for (int64_t i = 0; i < requests && out->failures.size() < 20 && absl::Now() < stop_at; ++i) {
    const Rpc& rpc = rpcs[rng() % rpcs.size()];
    const std::string bytes =
        rng() % 8 == 0 ? rpc.valid->SerializeAsString() : mutator.Mutate(*rpc.valid);
    // An accepted Join at the top of the generation range (--max-generation)
    // no longer locks Join out: the worker then accepts 1 + the highest
    // generation it saw (issue 13 item 3), which SetUp picks.
    std::chrono::milliseconds took;
    auto t0 = std::chrono::steady_clock::now();
    const grpc::Status status = target.Raw(rpc.method, bytes, &took);
    Charge(out, "call " + rpc.method, t0);
    ++out->calls;
    ++out->codes[absl::StrCat(rpc.method, " ", status.error_code())];
    std::unique_ptr<pb::Message> parsed(rpc.valid->New());
    const bool parses = parsed->ParseFromString(bytes);
    const bool documented = rpc.codes.count(status.error_code()) > 0 ||
                            (!parses && status.error_code() == StatusCode::INTERNAL);
    if (!documented) {
      out->failures.push_back(absl::StrCat(rpc.method, " returned undocumented code ",
                                           status.error_code(), ": ",
                                           status.error_message().substr(0, 300)));
    }
    if (took > kDeadline + kSlack) {
      out->failures.push_back(
          absl::StrCat(rpc.method, " took ", took.count(), " ms, past its deadline"));
    }
    v1::GetStatusResponse after;
    t0 = std::chrono::steady_clock::now();
    const bool answered_after = target.Snapshot(&after);
    Charge(out, "snapshot", t0);
    if (!answered_after) {
      out->failures.push_back(
          absl::StrCat(rpc.method, " (call ", i, "): the worker stopped answering after it"));
      return;
    }
    // DEADLINE_EXCEEDED from the client's own deadline does not say whether
    // the server finished (gRPC's semantics); one the server chose well
    // before that deadline (a Rendezvous wait that ran out, a request's
    // timeout_ms) is a rejection like any other.
    const bool client_gave_up =
        status.error_code() == StatusCode::DEADLINE_EXCEEDED && took >= kDeadline - kServerMargin;
    if (client_gave_up) {
      // The server may still finish what it accepted. Every Worker RPC that
      // changes what GetStatus shows (Lease aside) holds the collective slot
      // while it works and checks its deadline before taking it, so once a
      // call of our own has had the slot, the cut-off call is done or will
      // do nothing. Then settle for what does not take the slot.
      t0 = std::chrono::steady_clock::now();
      const grpc::Status barrier = target.SlotBarrier();
      if (barrier.error_code() != StatusCode::INVALID_ARGUMENT &&
          barrier.error_code() != StatusCode::FAILED_PRECONDITION) {
        out->failures.push_back(absl::StrCat("the slot barrier after ", rpc.method, " got code ",
                                             barrier.error_code(), ": ",
                                             barrier.error_message().substr(0, 200)));
        return;
      }
      if (!target.Snapshot(&after)) {
        out->failures.push_back(
            absl::StrCat(rpc.method, " (call ", i, "): the worker stopped answering after it"));
        return;
      }
      for (int settle = 0; settle < 40; ++settle) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        v1::GetStatusResponse again;
        if (!target.Snapshot(&again)) break;
        if (again.SerializeAsString() == after.SerializeAsString()) break;
        after = again;
      }
      Charge(out, "settle", t0);
    } else if (!status.ok()) {
      // A Join whose formation started records its generation (by design);
      // compared on a copy, as `after` is the next call's `before`.
      v1::GetStatusResponse compared = after;
      if (rpc.method == "/moe_ep.v1.Worker/Join") {
        compared.set_max_generation_seen(before.max_generation_seen());
      }
      if (compared.SerializeAsString() != before.SerializeAsString()) {
        out->failures.push_back(
            absl::StrCat(rpc.method, " was rejected (", status.error_code(), ": ",
                         status.error_message().substr(0, 200), ") yet changed the status from {",
                         before.ShortDebugString(), "} to {", after.ShortDebugString(), "}"));
      }
    }
    if (!after.lease_owner().empty()) {
      if (!target.ReleaseLease(after.lease_owner()) || !target.Snapshot(&after)) {
        out->failures.push_back(absl::StrCat("the lease of '", after.lease_owner().substr(0, 64),
                                             "' could not be released"));
        return;
      }
    }
    if (after.state() != v1::WORKER_STATE_ALLOCATED || after.world_size() != 1 ||
        after.geometry_epoch() != 1) {
      t0 = std::chrono::steady_clock::now();
      const bool set_up = target.SetUp(rpcs, &after);
      Charge(out, "set-up", t0);
      if (!set_up) {
        out->failures.push_back("set-up after an accepted call failed");
        return;
      }
    }
    before = std::move(after);
  }
}

TEST(Fuzz, MutatedRequestsOfEveryRpcNeverCrashHangOrChangeStateWhenRejected) {
  // Strings with invalid UTF-8 are part of the input; protobuf would log each.
  pb::SetLogHandler(nullptr);
  const int64_t requests = EnvInt("MOE_EP_FUZZ_REQUESTS", 20000);
  const uint64_t seed = static_cast<uint64_t>(EnvInt("MOE_EP_FUZZ_SEED", 13));
  // A long run (bench/results/fuzz.md) spreads the requests over more
  // workers and may stop at a time budget; CI uses the defaults.
  const int kWorkers = static_cast<int>(std::max<int64_t>(1, EnvInt("MOE_EP_FUZZ_WORKERS", 4)));
  const int64_t budget_s = EnvInt("MOE_EP_FUZZ_SECONDS", 0);
  client::LocalClusterOptions options;
  options.num_workers = kWorkers;
  options.backend = "gloo";
  options.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  // Up to 16 workers share the host (the long run): a cap of 256 MiB each
  // keeps accepted request-sized allocations from taking the machine's
  // memory, and makes RESOURCE_EXHAUSTED reachable at small sizes.
  options.extra_args = {"--checkpoint-dir=/tmp", "--memory-cap-bytes=268435456"};
  options.stop_timeout = absl::Seconds(5);
  auto cluster = client::LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<Findings> findings(kWorkers);
  double workers_cpu_start = 0;
  for (int w = 0; w < kWorkers; ++w) workers_cpu_start += ProcessCpuSeconds((*cluster)->pid(w));
  const double client_cpu_start = ProcessCpuSeconds(getpid());
  const absl::Time start = absl::Now();
  const absl::Time stop_at =
      budget_s > 0 ? start + absl::Seconds(budget_s) : absl::InfiniteFuture();
  std::vector<std::thread> threads;
  threads.reserve(kWorkers);
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      Fuzz((*cluster)->targets()[w], seed + w, requests / kWorkers, stop_at, &findings[w]);
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double client_cpu = ProcessCpuSeconds(getpid()) - client_cpu_start;
  double workers_cpu = -workers_cpu_start;
  for (int w = 0; w < kWorkers; ++w) workers_cpu += ProcessCpuSeconds((*cluster)->pid(w));
  int64_t calls = 0;
  std::map<std::string, int64_t> codes;
  std::map<std::string, double> wall_ms;
  std::map<std::string, int64_t> counts;
  for (int w = 0; w < kWorkers; ++w) {
    calls += findings[w].calls;
    for (const auto& [key, count] : findings[w].codes) codes[key] += count;
    for (const auto& [key, ms] : findings[w].wall_ms) wall_ms[key] += ms;
    for (const auto& [key, count] : findings[w].counts) counts[key] += count;
    for (const std::string& failure : findings[w].failures) {
      ADD_FAILURE() << "worker " << w << ": " << failure;
    }
    EXPECT_TRUE((*cluster)->IsRunning(w)) << "worker " << w << " exited";
  }
  std::cout << "fuzz: " << calls << " requests in " << seconds << " s ("
            << static_cast<int64_t>(calls / seconds) << " requests/s), seed " << seed << ", "
            << kWorkers << " workers\n";
  if (calls > 0) {
    std::cout << "CPU per request: " << 1e3 * client_cpu / calls << " ms client + "
              << 1e3 * workers_cpu / calls
              << " ms workers = " << 1e3 * (client_cpu + workers_cpu) / calls << " ms\n";
  }
  for (const auto& [key, count] : codes) std::cout << "  " << key << ": " << count << "\n";
  std::cout << "wall time of the client threads (ms total, count, ms each):\n";
  for (const auto& [key, ms] : wall_ms) {
    std::cout << "  " << key << ": " << static_cast<int64_t>(ms) << " ms, " << counts[key] << ", "
              << ms / counts[key] << "\n";
  }
  if (budget_s == 0) {
    EXPECT_GE(calls, requests - kWorkers);
  }
}

}  // namespace
}  // namespace moe_ep::testing
