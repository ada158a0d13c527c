#include "server/reflection_v1.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "server/rendezvous_service.h"

namespace moe_ep::server {
namespace {

using ::google::protobuf::UnknownField;
using ::google::protobuf::UnknownFieldSet;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// grpc.reflection.v1 (and v1alpha) ServerReflectionRequest, hand-encoded:
//   string list_services = 7;  string file_containing_symbol = 4;
std::string ListServicesRequest() { return std::string("\x3a\x00", 2); }
std::string FileContainingSymbolRequest(const std::string& symbol) {
  return std::string("\x22") + static_cast<char>(symbol.size()) + symbol;  // < 128 bytes
}

struct Exchange {
  grpc::Status status;
  std::vector<std::string> responses;  // serialized ServerReflectionResponse
};

// Sends `requests` on one `method` stream, then half-closes; collects every
// response until the server ends the stream. Blocking (async API + a CQ).
Exchange Call(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
              const std::vector<std::string>& requests) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  void* tag;
  bool ok;
  auto call = stub.PrepareCall(&context, method, &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  Exchange result;
  const bool started = cq.Next(&tag, &ok) && ok;
  for (const std::string& r : requests) {
    if (!started) break;
    grpc::Slice slice(r);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, reinterpret_cast<void*>(2));
    if (!cq.Next(&tag, &ok) || !ok) break;
  }
  if (started) {
    call->WritesDone(reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
    while (true) {
      grpc::ByteBuffer buffer;
      call->Read(&buffer, reinterpret_cast<void*>(4));
      if (!cq.Next(&tag, &ok) || !ok) break;
      std::vector<grpc::Slice> slices;
      (void)buffer.Dump(&slices);
      std::string bytes;
      for (const grpc::Slice& s : slices) bytes.append(s.begin(), s.end());
      result.responses.push_back(bytes);
    }
  }
  call->Finish(&result.status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return result;
}

// The length-delimited fields `number` of the message `bytes` (raw payloads).
std::vector<std::string> Fields(const std::string& bytes, int number) {
  UnknownFieldSet fields;
  std::vector<std::string> out;
  if (!fields.ParseFromString(bytes)) return out;
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& f = fields.field(i);
    if (f.number() == number && f.type() == UnknownField::TYPE_LENGTH_DELIMITED) {
      out.push_back(f.length_delimited());
    }
  }
  return out;
}

// The varint fields `number` of the message `bytes`.
std::vector<uint64_t> Varints(const std::string& bytes, int number) {
  UnknownFieldSet fields;
  std::vector<uint64_t> out;
  if (!fields.ParseFromString(bytes)) return out;
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& f = fields.field(i);
    if (f.number() == number && f.type() == UnknownField::TYPE_VARINT) out.push_back(f.varint());
  }
  return out;
}

// ServerReflectionResponse.list_services_response (6) -> service (1) -> name (1).
std::vector<std::string> ServiceNames(const std::string& response) {
  std::vector<std::string> names;
  for (const std::string& list : Fields(response, 6)) {
    for (const std::string& service : Fields(list, 1)) {
      for (const std::string& name : Fields(service, 1)) names.push_back(name);
    }
  }
  return names;
}

class ReflectionV1Test : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&rendezvous_);
    builder.RegisterCallbackGenericService(&reflection_v1_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    reflection_v1_.Attach(server_.get());
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials());
  }
  void TearDown() override { server_->Shutdown(); }

  RendezvousService rendezvous_;
  ReflectionV1Service reflection_v1_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(ReflectionV1Test, V1ListsTheServicesAsV1AlphaDoes) {
  const Exchange v1 = Call(channel_, kReflectionV1Method, {ListServicesRequest()});
  ASSERT_TRUE(v1.status.ok()) << v1.status.error_message();
  ASSERT_EQ(v1.responses.size(), 1u);
  const std::vector<std::string> names = ServiceNames(v1.responses[0]);
  EXPECT_THAT(names, Contains("moe_ep.v1.Rendezvous"));
  EXPECT_THAT(names, Contains("grpc.reflection.v1alpha.ServerReflection"));

  const Exchange alpha =
      Call(channel_, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
           {ListServicesRequest()});
  ASSERT_TRUE(alpha.status.ok()) << alpha.status.error_message();
  EXPECT_EQ(alpha.responses, v1.responses);  // wire-identical answers
}

TEST_F(ReflectionV1Test, V1AnswersEveryRequestOfAStreamInOrder) {
  const Exchange v1 = Call(channel_, kReflectionV1Method,
                           {FileContainingSymbolRequest("moe_ep.v1.Rendezvous"),
                            ListServicesRequest(), FileContainingSymbolRequest("no.such.Symbol")});
  ASSERT_TRUE(v1.status.ok()) << v1.status.error_message();
  ASSERT_EQ(v1.responses.size(), 3u);
  // file_descriptor_response (4) -> file_descriptor_proto (1) -> name (1).
  std::vector<std::string> file_names;
  for (const std::string& response : Fields(v1.responses[0], 4)) {
    for (const std::string& file : Fields(response, 1)) {
      for (const std::string& name : Fields(file, 1)) file_names.push_back(name);
    }
  }
  EXPECT_THAT(file_names, Contains("moe_ep/v1/rendezvous.proto"));
  EXPECT_THAT(ServiceNames(v1.responses[1]), Contains("moe_ep.v1.Rendezvous"));
  // error_response (7) for an unknown symbol: error_code (1) NOT_FOUND (5).
  const std::vector<std::string> errors = Fields(v1.responses[2], 7);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_THAT(Varints(errors[0], 1), ::testing::ElementsAre(5u));
}

TEST_F(ReflectionV1Test, OtherUnknownMethodsStayUnimplemented) {
  const Exchange other = Call(channel_, "/moe_ep.v1.Nothing/Here", {ListServicesRequest()});
  EXPECT_EQ(other.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(other.status.error_message(), HasSubstr("/moe_ep.v1.Nothing/Here"));
  EXPECT_THAT(other.responses, IsEmpty());
}

TEST(ReflectionV1Service, BeforeAttachIsUnavailable) {
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  ReflectionV1Service reflection_v1;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&reflection_v1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const Exchange v1 = Call(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()),
      kReflectionV1Method, {ListServicesRequest()});
  EXPECT_EQ(v1.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  server->Shutdown();
}

}  // namespace
}  // namespace moe_ep::server
