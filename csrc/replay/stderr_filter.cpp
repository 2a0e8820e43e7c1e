#include "replay/stderr_filter.h"

#include <unistd.h>

#include <cstdio>
#include <string>

namespace kvexport::replay {

namespace {

// Threads that fail at once interleave the wrapper's "Error: " and its message, so a line is
// AOTInductor's when it holds the message's signature or only "Error: " fragments.
bool is_aoti_error_line(const std::string& line) {
  if (line.find(" API call failed at ") != std::string::npos) return true;
  std::string rest = line;
  for (size_t at; (at = rest.find("Error: ")) != std::string::npos;) rest.erase(at, 7);
  return rest != line && rest.find_first_not_of(" \n") == std::string::npos;
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const auto n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

StderrFilter::StderrFilter() {
  int fds[2];
  std::fflush(stderr);
  if (pipe(fds) != 0) return;  // no filter: raw lines pass, nothing else changes
  original_ = dup(STDERR_FILENO);
  dup2(fds[1], STDERR_FILENO);
  close(fds[1]);
  read_end_ = fds[0];
  forwarder_ = std::thread([this] { forward(); });
}

StderrFilter::~StderrFilter() {
  if (original_ < 0) return;
  std::fflush(stderr);
  dup2(original_, STDERR_FILENO);  // closes the pipe's last write end: the forwarder sees EOF
  forwarder_.join();
  close(read_end_);
  close(original_);
}

void StderrFilter::forward() {
  std::string pending;
  char buffer[4096];
  ssize_t n;
  while ((n = read(read_end_, buffer, sizeof(buffer))) > 0) {
    pending.append(buffer, static_cast<size_t>(n));
    size_t end;
    while ((end = pending.find('\n')) != std::string::npos) {
      const std::string line = pending.substr(0, end + 1);
      pending.erase(0, end + 1);
      if (!is_aoti_error_line(line)) write_all(original_, line);
    }
  }
  if (!pending.empty() && !is_aoti_error_line(pending)) write_all(original_, pending);
}

}  // namespace kvexport::replay
