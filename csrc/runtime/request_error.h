// Why a request failed, as hosts learn it: a code and a one-line message recorded by the op
// that refused the request, read back through kvexport::last_error. Hosts never parse exception
// text (AOTInductor versions differ in what of it they pass on).
#pragma once

#include <stdexcept>
#include <string>

namespace kvexport::runtime {

enum class ErrorCode {
  kOk,                // the calling thread's last request on this runtime succeeded
  kInvalidRequest,    // the request breaks the signature or the package's declared limits
  kCapacityExceeded,  // the batch cannot fit the device tier even after evicting every other user
  kInternal,          // anything else (a bug, out of memory, a request preempted after stalling)
};

// The stable name hosts compare against: "ok", "invalid_request", "capacity_exceeded", "internal".
const char* error_code_name(ErrorCode code);

// A request the runtime refuses; the runtime state is unchanged when it is thrown.
class RequestError : public std::invalid_argument {
 public:
  RequestError(ErrorCode code, const std::string& message) : std::invalid_argument(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

struct LastError {
  ErrorCode code = ErrorCode::kOk;
  std::string message;
};

// Per calling thread and runtime name: a thread's request is the only one it can ask about.
void clear_last_error(const std::string& runtime);
void record_last_error(const std::string& runtime, ErrorCode code, const std::string& message);
LastError last_error(const std::string& runtime);

}  // namespace kvexport::runtime
