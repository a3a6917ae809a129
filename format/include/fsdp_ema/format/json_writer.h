// The one JSON writer for documents fsdp_ema hands to others (checkpoint_info, posthoc_plan):
// compact output, strings escaped by json_strict.h's append_json_quoted (the rule every file
// writer of format/ uses too), doubles in their shortest round-trip form, non-finite ones as null.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp_ema::format {

class JsonWriter {
 public:
  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  // The key of the next value (inside an object).
  JsonWriter& key(std::string_view k);
  JsonWriter& value(std::string_view v);
  JsonWriter& value(const char* v) { return value(std::string_view(v)); }
  JsonWriter& value(int64_t v);
  JsonWriter& value(double v);
  JsonWriter& value(bool v);
  JsonWriter& null();
  template <typename T>
  JsonWriter& array(std::span<const T> values) {
    begin_array();
    for (const T& v : values) value(v);
    return end_array();
  }
  const std::string& str() const { return out_; }

 private:
  void separate();                  // a comma before every element or member but the first
  JsonWriter& open(char bracket);   // '{' or '['
  JsonWriter& close(char bracket);  // '}' or ']'
  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
  bool after_key_ = false;
};

}  // namespace fsdp_ema::format
