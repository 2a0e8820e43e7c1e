#include "runtime/url_redaction.h"

#include <regex>

namespace kvexport::runtime {

size_t scheme_length(const std::string& url) {
  static const std::regex scheme(R"(^[A-Za-z][A-Za-z0-9+.\-]*://)");
  std::smatch match;
  return std::regex_search(url, match, scheme) ? static_cast<size_t>(match.length(0)) : 0;
}

std::string redact_url(const std::string& url) {
  // Everything before the last '@' may be a credential, however malformed the rest of the URL.
  const auto at = url.rfind('@');
  if (at == std::string::npos) return url;
  const auto scheme = scheme_length(url);
  const auto keep = scheme <= at ? scheme : 0;
  return url.substr(0, keep) + "***" + url.substr(at);
}

}  // namespace kvexport::runtime
