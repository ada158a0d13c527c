#include "client/proto_json.h"

#include <string>

#include "absl/strings/escaping.h"
#include "google/protobuf/descriptor.h"

namespace moe_ep::client {
namespace {

namespace pb = ::google::protobuf;

constexpr int kMaxDepth = 16;

nlohmann::json MessageJson(const pb::Message& message, int depth);

// One value of `field` (element `index` of a repeated field, -1 for a
// singular one).
nlohmann::json FieldValue(const pb::Message& m, const pb::FieldDescriptor* f, int index,
                          int depth) {
  const pb::Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f);
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f);
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f);
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f);
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f);
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f);
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f);
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      const int value = rep ? r->GetRepeatedEnumValue(m, f, index) : r->GetEnumValue(m, f);
      const pb::EnumValueDescriptor* named = f->enum_type()->FindValueByNumber(value);
      return named != nullptr ? nlohmann::json(named->name()) : nlohmann::json(value);
    }
    case pb::FieldDescriptor::CPPTYPE_STRING: {
      const std::string value = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      if (f->type() == pb::FieldDescriptor::TYPE_BYTES) return absl::Base64Escape(value);
      // Invalid UTF-8 must not make dump() throw later: replace it now.
      return nlohmann::json::parse(
          nlohmann::json(value).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    }
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      return MessageJson(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f), depth + 1);
  }
  return nullptr;
}

nlohmann::json MessageJson(const pb::Message& message, int depth) {
  if (depth > kMaxDepth) return nullptr;
  nlohmann::json out = nlohmann::json::object();
  const pb::Descriptor* d = message.GetDescriptor();
  const pb::Reflection* r = message.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) {
      nlohmann::json values = nlohmann::json::array();
      const int n = r->FieldSize(message, f);
      for (int k = 0; k < n; ++k) values.push_back(FieldValue(message, f, k, depth));
      out[f->name()] = std::move(values);
    } else {
      out[f->name()] = FieldValue(message, f, -1, depth);
    }
  }
  return out;
}

}  // namespace

nlohmann::json ProtoToJson(const google::protobuf::Message& message) {
  return MessageJson(message, 0);
}

}  // namespace moe_ep::client
