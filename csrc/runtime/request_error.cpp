#include "runtime/request_error.h"

#include <unordered_map>

namespace kvexport::runtime {

namespace {

std::unordered_map<std::string, LastError>& thread_errors() {
  thread_local std::unordered_map<std::string, LastError> errors;
  return errors;
}

}  // namespace

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidRequest:
      return "invalid_request";
    case ErrorCode::kCapacityExceeded:
      return "capacity_exceeded";
    case ErrorCode::kInternal:
      return "internal";
  }
  return "internal";
}

void clear_last_error(const std::string& runtime) {
  thread_errors()[runtime] = LastError{};
}

void record_last_error(const std::string& runtime, ErrorCode code, const std::string& message) {
  thread_errors()[runtime] = LastError{code, message};
}

LastError last_error(const std::string& runtime) {
  auto& errors = thread_errors();
  auto it = errors.find(runtime);
  return it == errors.end() ? LastError{} : it->second;
}

}  // namespace kvexport::runtime
