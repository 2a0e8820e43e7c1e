// Hiding the credentials of a remote tier's URL in messages and logs: the one statement of the rule,
// for the op library, the C++ harness and (through kvexport::redact_url) Python.
#pragma once

#include <cstddef>
#include <string>

namespace kvexport::runtime {

// The length of url's "scheme://" (RFC 3986 scheme), or 0.
size_t scheme_length(const std::string& url);

// `url` for a message: everything between its scheme (an RFC 3986 "scheme://", else none) and its
// last '@' (user and password, however malformed the URL) as ***.
std::string redact_url(const std::string& url);

}  // namespace kvexport::runtime
