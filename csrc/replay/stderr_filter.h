// Keeps AOTInductor's own error lines off stderr while the harness runs.
//
// When an op refuses a request, the package's generated wrapper prints
// "Error: <call> API call failed at <its build path>, line N" before rethrowing. The harness
// reports every refusal itself, with the runtime's code and message, so those raw lines are
// noise for expected refusals and leak the build host's paths.
#pragma once

#include <thread>

namespace kvexport::replay {

class StderrFilter {
 public:
  StderrFilter();   // routes fd 2 through a pipe read by a forwarding thread
  ~StderrFilter();  // restores fd 2 and forwards whatever is left
  StderrFilter(const StderrFilter&) = delete;
  StderrFilter& operator=(const StderrFilter&) = delete;

 private:
  void forward();

  int original_ = -1;
  int read_end_ = -1;
  std::thread forwarder_;
};

}  // namespace kvexport::replay
