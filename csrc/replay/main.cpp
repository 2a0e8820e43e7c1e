// kvexport_replay: replays an artifact's recorded trace through AOTIModelPackageLoader, without
// Python, and compares every step with the eager model's cached and full-recompute outputs.
//
//   kvexport_replay --artifact OUT [--library PATH]... [--atol X] [--rtol X] [--json FILE]
//                   [--repeat N] [--threads N] [--hostile FILE] [--route model|step|graphs]
//                   [--remote URL [--remote-write POLICY] [--remote-password-file FILE]]
//
// --route: model (default) runs model.pt2, which plans and runs each whole request, as plain hosts
// do; step plans each request on the host and runs the artifact's step.pt2 (docs/design.md 3.9);
// graphs does too, on a GPU as one CUDA graph per bucket.
//
// --hostile FILE: a torch.save'd list of requests (dicts of tensors) the package must refuse;
// each thread sends all of them before every trace step, and each must fail with the runtime's
// "invalid_request" code while the trace's outputs stay correct.
//
// --remote URL: share user caches through a Redis/Valkey server
// (redis://[[user]:password@]host[:port][/db]) as kvexport.load(remote=...) does; --remote-write is
// on_evict (default) or after_batch; --remote-password-file FILE: the server's password, read from
// FILE rather than given in the URL (where the process list would show it). A server that does not
// answer: one warning line, and the replay runs without the tier; one that refuses the password:
// unusable input. Messages never repeat the URL (it may hold a password).
//
// Exit codes: 0 pass, 1 mismatch (an output outside tolerance, or a file that differs from the
// manifest), 2 unusable input. `kvexport replay` locates the libraries and passes these flags.
#include <dlfcn.h>
#include <stdlib.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "replay/artifact.h"
#include "replay/isa.h"
#include "replay/ops.h"
#include "replay/requests.h"
#include "replay/shared_objects.h"
#include "replay/stderr_filter.h"
#include "replay/step_scorer.h"

namespace kvexport::replay {
namespace {

struct Options {
  fs::path artifact;
  std::vector<fs::path> libraries;
  std::optional<double> atol, rtol;
  std::optional<fs::path> json;
  int repeat = 1;
  int threads = 1;
  std::optional<fs::path> hostile;
  std::optional<std::string> remote;
  std::optional<fs::path> remote_password_file;
  std::string remote_write = "on_evict";
  std::string route = "model";
};

// How long the harness waits at the end for the remote tier's queued writes (kvexport.remote.FLUSH_TIMEOUT_MS).
constexpr int64_t kRemoteFlushTimeoutMs = 5000;

const char* kUsage =
    "usage: kvexport_replay --artifact OUT [--library PATH]... [--atol X] [--rtol X] [--json FILE] "
    "[--repeat N] [--threads N] [--hostile FILE] [--route model|step|graphs] "
    "[--remote URL [--remote-write POLICY] [--remote-password-file FILE]]";

Options parse_options(int argc, char** argv) {
  Options o;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw ReplayError(kUnusable, std::string(argv[i]) + " needs a value\n" + kUsage);
    return argv[++i];
  };
  auto positive = [&](const std::string& flag, const std::string& text) {
    try {
      const int n = std::stoi(text);
      if (n >= 1) return n;
    } catch (const std::exception&) {
    }
    throw ReplayError(kUnusable, flag + " must be a positive integer, got " + text);
  };
  auto number = [&](const std::string& flag, const std::string& text) {
    try {
      return std::stod(text);
    } catch (const std::exception&) {
      throw ReplayError(kUnusable, flag + " must be a number, got " + text);
    }
  };
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--artifact")
      o.artifact = value(i);
    else if (flag == "--library")
      o.libraries.emplace_back(value(i));
    else if (flag == "--atol")
      o.atol = number(flag, value(i));
    else if (flag == "--rtol")
      o.rtol = number(flag, value(i));
    else if (flag == "--json")
      o.json = fs::path(value(i));
    else if (flag == "--repeat")
      o.repeat = positive(flag, value(i));
    else if (flag == "--threads")
      o.threads = positive(flag, value(i));
    else if (flag == "--hostile")
      o.hostile = fs::path(value(i));
    else if (flag == "--remote")
      o.remote = value(i);
    else if (flag == "--remote-write")
      o.remote_write = value(i);
    else if (flag == "--remote-password-file")
      o.remote_password_file = fs::path(value(i));
    else if (flag == "--route")
      o.route = value(i);
    else if (flag == "--help" || flag == "-h")
      throw ReplayError(kPass, kUsage);
    else
      throw ReplayError(kUnusable, "unknown flag " + flag + "\n" + kUsage);
  }
  if (o.artifact.empty()) throw ReplayError(kUnusable, std::string("--artifact is required\n") + kUsage);
  if (o.remote_password_file && !o.remote) throw ReplayError(kUnusable, "--remote-password-file needs --remote URL");
  if (o.route != "model" && o.route != "step" && o.route != "graphs") {
    throw ReplayError(kUnusable, "--route must be model, step or graphs, got " + o.route);
  }
  return o;
}

// The package calls custom ops by schema; their libraries must be loaded (globally) first.
void load_libraries(const Manifest& manifest, const Options& options) {
  std::vector<fs::path> paths = {manifest.root / "lib" / "libkvexport_ops.so"};
  paths.insert(paths.end(), options.libraries.begin(), options.libraries.end());
  for (const auto& name : manifest.required_libraries) {
    const bool given = std::any_of(paths.begin(), paths.end(),
                                   [&](const fs::path& p) { return p.stem() == name || p.stem() == "lib" + name; });
    if (!given) {
      throw ReplayError(kUnusable, "the package needs op library " + name + "; pass it with --library PATH");
    }
  }
  for (const auto& path : paths) {
    if (!fs::is_regular_file(path)) throw ReplayError(kUnusable, "op library " + path.string() + " is missing");
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      throw ReplayError(kUnusable, "cannot load op library " + path.string() + ": " + dlerror());
    }
  }
}

// Counter names come from the op library, which owns them.
std::map<std::string, int64_t> runtime_stats(const std::string& runtime) {
  const auto result = call_op("kvexport::stat_names", {});
  const auto names = result.at(0).toListRef();
  const auto values = call_op("kvexport::runtime_stats", {runtime})[0].toTensor();
  TORCH_CHECK(values.numel() == static_cast<int64_t>(names.size()), "kvexport bug: runtime_stats has ", values.numel(),
              " values for ", names.size(), " names");
  std::map<std::string, int64_t> stats;
  for (size_t i = 0; i < names.size(); ++i) stats[names[i].toStringRef()] = values[i].item<int64_t>();
  return stats;
}

// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool is_utf8(const std::string& text) {
  for (size_t i = 0; i < text.size();) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const size_t length = byte < 0x80           ? 1
                          : (byte >> 5) == 0x6  ? 2
                          : (byte >> 4) == 0xE  ? 3
                          : (byte >> 3) == 0x1E ? 4
                                                : 0;
    if (length == 0 || i + length > text.size()) return false;
    uint32_t code = length == 1 ? byte : byte & (0x7F >> length);
    for (size_t k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next >> 6) != 0x2) return false;
      code = (code << 6) | (next & 0x3F);
    }
    static constexpr uint32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
    if (code < kSmallest[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
    i += length;
  }
  return true;
}

// The password a file holds, by the rules and messages of kvexport/contract.json's password_file
// (kvexport.remote.read_password_file follows them too).
std::string read_password_file(const fs::path& path) {
  const std::map<std::string, std::string> named{{"path", path.string()}};
  std::error_code error;
  const auto status = fs::status(path, error);
  if (status.type() == fs::file_type::not_found) throw contract_failure("password_file_missing", named);
  if (error) throw contract_failure("password_file_unreadable", {{"path", path.string()}, {"reason", error.message()}});
  if (!fs::is_regular_file(status)) throw contract_failure("password_file_not_regular", named);
  const auto max_bytes = contract().at("password_file").at("max_bytes").get<std::streamsize>();
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  std::string password(static_cast<size_t>(max_bytes) + 1, '\0');
  in.read(password.data(), max_bytes + 1);  // one byte past the limit tells a file over it
  password.resize(static_cast<size_t>(in.gcount()));
  if (!in.is_open() || in.bad()) {
    throw contract_failure("password_file_unreadable",
                           {{"path", path.string()}, {"reason", std::strerror(errno ? errno : EIO)}});
  }
  if (static_cast<std::streamsize>(password.size()) > max_bytes) {
    throw contract_failure("password_file_too_large",
                           {{"path", path.string()}, {"max_bytes", std::to_string(max_bytes)}});
  }
  if (password.starts_with("\xEF\xBB\xBF")) throw contract_failure("password_file_bom", named);
  if (password.ends_with("\r\n"))
    password.resize(password.size() - 2);
  else if (password.ends_with('\n'))
    password.pop_back();
  if (password.empty()) throw contract_failure("password_file_empty", named);
  if (password.find_first_of("\r\n") != std::string::npos) throw contract_failure("password_file_lines", named);
  if (!is_utf8(password)) throw contract_failure("password_file_not_utf8", named);
  return password;
}

// `url` (redis://[user@]host...) with `password` added, percent-encoded
// (kvexport.remote.url_with_password).
std::string url_with_password(const std::string& url, const std::string& password) {
  const auto scheme = url.find("://");
  if (scheme == std::string::npos) return url;  // not a URL: attach_remote refuses it
  const auto start = scheme + 3;
  const auto at = url.rfind('@', url.find('/', start));
  const bool has_user = at != std::string::npos && at >= start;
  const std::string user = has_user ? url.substr(start, at - start) : "";
  if (user.find(':') != std::string::npos) {
    throw ReplayError(kUnusable,
                      "the remote URL holds a password already: give it there or in a password file, not both");
  }
  std::string encoded;
  for (const unsigned char c : password) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      encoded += static_cast<char>(c);
    } else {
      char escape[4];
      std::snprintf(escape, sizeof(escape), "%%%02X", c);
      encoded += escape;
    }
  }
  return url.substr(0, start) + user + ":" + encoded + "@" + url.substr(has_user ? at + 1 : start);
}

// The remote tier behind the runtime's host tier; a bad URL or policy (or an op library built
// without the tier) is unusable input, a server that does not answer a warning.
void attach_remote(const std::string& runtime, const std::string& url, const std::string& write_policy) {
  bool attached = false;
  try {
    attached = call_op("kvexport::attach_remote", {runtime, url, write_policy})[0].toBool();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    throw ReplayError(kUnusable, what.substr(0, what.find('\n')));
  }
  if (!attached) {
    std::fprintf(stderr, "warning: the remote tier (--remote) is unreachable; runtime '%s' runs without it\n",
                 runtime.c_str());
  }
}

// The counters of the local tiers: the remote tier's move on their own (its writer is asynchronous).
std::map<std::string, int64_t> local_cache(std::map<std::string, int64_t> stats) {
  std::erase_if(stats, [](const auto& item) { return item.first.rfind("remote_", 0) == 0; });
  return stats;
}

// Why this thread's last request failed, as the runtime recorded it: {code, message}.
std::pair<std::string, std::string> last_error(const std::string& runtime) {
  const auto result = call_op("kvexport::last_error", {runtime});
  return {result.at(0).toStringRef(), result.at(1).toStringRef()};
}

struct Comparison {
  double max_abs = 0, max_rel = 0;
  bool passed = true;
};

Comparison compare(const at::Tensor& output, const at::Tensor& expected, double atol, double rtol) {
  if (output.sizes() != expected.sizes()) return {INFINITY, INFINITY, false};
  const auto diff = (output.to(at::kCPU).to(at::kFloat) - expected.to(at::kFloat)).abs();
  const auto scale = expected.to(at::kFloat).abs();
  Comparison c;
  c.passed = (diff <= atol + rtol * scale).all().item<bool>();
  if (diff.numel()) {
    c.max_abs = diff.max().item<double>();
    c.max_rel = (diff / (scale + atol)).max().item<double>();
  }
  return c;
}

// Keeps the worst of two comparisons of one step (over passes or threads).
void merge_worst(Comparison& into, const Comparison& c) {
  into.max_abs = std::max(into.max_abs, c.max_abs);
  into.max_rel = std::max(into.max_rel, c.max_rel);
  into.passed = into.passed && c.passed;
}

nlohmann::json to_json(const Comparison& c) {
  return {{"max_abs", c.max_abs}, {"max_rel", c.max_rel}, {"passed", c.passed}};
}

struct StepResult {
  Comparison vs_cached, vs_full, vs_reference;
  int64_t batch_size = 0, hit_tokens = 0, recomputed_tokens = 0;
  std::vector<double> latencies_ms;
};

double percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const auto index = static_cast<size_t>(q * (values.size() - 1) + 0.5);
  return values[std::min(index, values.size() - 1)];
}

// Loads every trace step once; inputs in the package's signature order, on the host (where a
// package takes its request, whatever its device).
struct LoadedStep {
  std::vector<at::Tensor> inputs;
  at::Tensor expected_cached, expected_full, expected_reference;
  std::string expect_error;
};

std::vector<LoadedStep> load_trace(const Manifest& manifest, const std::vector<std::string>& signature) {
  std::vector<LoadedStep> steps;
  for (const auto& step : manifest.steps) {
    auto tensors = load_step(manifest, step);
    LoadedStep loaded;
    loaded.expect_error = step.expect_error;
    for (const auto& name : signature) {
      if (!tensors.count(name)) throw ReplayError(kUnusable, "trace file " + step.file + " lacks " + name);
      loaded.inputs.push_back(tensors.at(name));
    }
    if (loaded.expect_error.empty()) {
      loaded.expected_cached = tensors.at(trace_keys().expected_cached);
      loaded.expected_full = tensors.at(trace_keys().expected_full);
      loaded.expected_reference = tensors.at(trace_keys().expected_reference);
    }
    steps.push_back(std::move(loaded));
  }
  return steps;
}

// A request recorded as failing passes when the package refuses it with the expected error code
// (read from the runtime: the exception's text differs between torch versions).
bool expect_failure(Scorer& scorer, const std::string& runtime, const std::vector<at::Tensor>& inputs,
                    const std::string& expected_code) {
  try {
    scorer.score(inputs);
  } catch (const std::exception&) {
    return last_error(runtime).first == expected_code;
  }
  return false;
}

// A trace request the package must serve; a refusal is reported with the runtime's reason.
at::Tensor run_step(Scorer& scorer, const std::string& runtime, size_t index, const LoadedStep& step) {
  try {
    return scorer.score(step.inputs);
  } catch (const std::exception&) {
    const auto [code, message] = last_error(runtime);
    throw ReplayError(kMismatch, "step " + std::to_string(index) + " was refused (" + code + "): " + message);
  }
}

std::vector<std::vector<at::Tensor>> load_hostile(const fs::path& path, const std::vector<std::string>& signature) {
  std::vector<std::vector<at::Tensor>> requests;
  for (const auto& request : load_request_list(path)) {
    std::vector<at::Tensor> inputs;
    for (const auto& name : signature) {
      if (!request.count(name)) throw ReplayError(kUnusable, "a --hostile request lacks " + name);
      inputs.push_back(request.at(name));
    }
    requests.push_back(std::move(inputs));
  }
  return requests;
}

struct Replay {
  Scorer& scorer;
  std::string runtime;
  std::vector<LoadedStep> steps;
  std::vector<std::vector<at::Tensor>> hostile;
  double atol = 0, rtol = 0;
};

// Sends every hostile request; each must be refused as invalid. Returns how many were not.
int send_hostile(const Replay& replay) {
  int accepted = 0;
  for (const auto& inputs : replay.hostile) {
    accepted += !expect_failure(replay.scorer, replay.runtime, inputs, "invalid_request");
  }
  return accepted;
}

// Replays the trace `repeat` times from an empty cache; every pass is compared.
void replay_pass(const Replay& replay, std::vector<StepResult>& results, bool count_cache) {
  auto& scorer = replay.scorer;
  const auto& runtime = replay.runtime;
  const auto& steps = replay.steps;
  const double atol = replay.atol, rtol = replay.rtol;
  for (size_t i = 0; i < steps.size(); ++i) {
    const int hostile_accepted = send_hostile(replay);
    const auto before = count_cache ? runtime_stats(runtime) : std::map<std::string, int64_t>{};
    // The latency is the package call's alone (as the Python runner's): comparisons are not timed.
    const auto started = std::chrono::steady_clock::now();
    const auto elapsed_ms = [&] {
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    };
    double ms = 0;
    Comparison vs_cached, vs_full, vs_reference;
    if (steps[i].expect_error.empty()) {
      const auto output = run_step(scorer, runtime, i, steps[i]);
      if (output.is_cuda()) torch::cuda::synchronize(output.get_device());  // as Python times it
      ms = elapsed_ms();
      vs_cached = compare(output, steps[i].expected_cached, atol, rtol);
      vs_full = compare(output, steps[i].expected_full, atol, rtol);
      vs_reference = compare(output, steps[i].expected_reference, atol, rtol);
    } else {
      vs_cached.passed = expect_failure(scorer, runtime, steps[i].inputs, steps[i].expect_error);
      ms = elapsed_ms();
      vs_full = vs_cached;
    }
    if (hostile_accepted) vs_cached.passed = vs_full.passed = false;
    auto& r = results[i];
    r.latencies_ms.push_back(ms);
    r.batch_size = steps[i].inputs[0].size(0);
    merge_worst(r.vs_cached, vs_cached);
    merge_worst(r.vs_full, vs_full);
    merge_worst(r.vs_reference, vs_reference);
    if (count_cache) {
      const auto after = runtime_stats(runtime);
      if (!steps[i].expect_error.empty() && local_cache(after) != local_cache(before)) {
        r.vs_cached.passed = r.vs_full.passed = false;  // a failed batch must leave the cache as it was
      }
      r.hit_tokens = after.at("hit_tokens") - before.at("hit_tokens");
      r.recomputed_tokens = after.at("recomputed_tokens") - before.at("recomputed_tokens");
    }
  }
}

// The table kvexport/trace/report.py prints too; the description column fits the longest one, so
// no description is cut.
void print_report(const nlohmann::json& report) {
  int width = 11;
  for (const auto& s : report["steps"]) {
    width = std::max(width, static_cast<int>(s["description"].get<std::string>().size()));
  }
  std::printf("%4s %2s  %-*s %19s %21s %9s %5s %5s %7s  ok\n", "step", "B", width, "description", "vs cached abs/rel",
              "vs recompute abs/rel", "vs fp32", "hit", "new", "ms");
  int passed = 0;
  for (const auto& s : report["steps"]) {
    const auto& c = s["vs_cached"];
    const auto& f = s["vs_full"];
    const auto& r = s["vs_reference"];
    passed += s["passed"].get<bool>();
    std::printf("%4d %2d  %-*s %9.1e/%-9.1e %10.1e/%-10.1e %9.1e %5lld %5lld %7.2f  %s\n", s["index"].get<int>(),
                s["batch_size"].get<int>(), width, s["description"].get<std::string>().c_str(),
                c["max_abs"].get<double>(), c["max_rel"].get<double>(), f["max_abs"].get<double>(),
                f["max_rel"].get<double>(), r["max_abs"].get<double>(),
                static_cast<long long>(s["hit_tokens"].get<int64_t>()),
                static_cast<long long>(s["recomputed_tokens"].get<int64_t>()), s["latency_ms"].get<double>(),
                s["passed"].get<bool>() ? "ok" : "FAIL");
  }
  std::printf("verdict: %s (cpp: %d/%zu steps within atol %g, rtol %g; %d files checked)\n",
              report["passed"].get<bool>() ? "PASS" : "FAIL", passed, report["steps"].size(),
              report["atol"].get<double>(), report["rtol"].get<double>(), report["files_checked"].get<int>());
}

// AOTIModelPackageLoader extracts the package into a temporary directory and does not remove it
// when its constructor throws. The harness therefore gives it a private TMPDIR that it always
// removes itself, so no extraction directory outlives the process, on success or failure.
class PrivateTempDir {
 public:
  PrivateTempDir() {
    std::string pattern = (fs::temp_directory_path() / "kvexport-replay-XXXXXX").string();
    if (!mkdtemp(pattern.data())) throw ReplayError(kUnusable, "cannot create a temporary directory");
    path_ = pattern;
    setenv("TMPDIR", path_.c_str(), 1);
  }
  ~PrivateTempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }

 private:
  fs::path path_;
};

std::unique_ptr<torch::inductor::AOTIModelPackageLoader> load_package(const Manifest& manifest, int num_runners) {
  const auto package = manifest.root / "model.pt2";
  check_shared_objects(package);
  try {
    return std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        package.string(), "model", /*run_single_threaded=*/false, static_cast<size_t>(num_runners));
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    const std::string marker = "Could not find schema for ";
    const auto schema = what.find(marker);
    if (schema != std::string::npos) {
      const auto begin = schema + marker.size();
      const auto op = what.substr(begin, what.find_first_of(".\n", begin) - begin);
      throw ReplayError(kUnusable, "model.pt2 calls " + op +
                                       " but no loaded library defines it; pass its "
                                       "library with --library PATH");
    }
    throw ReplayError(kUnusable, "cannot load model.pt2: " + what.substr(0, what.find('\n')));
  }
}

// The route's scorer: model.pt2 through `loader`, or the artifact's step.pt2 (loaded here).
std::unique_ptr<Scorer> make_scorer(const Manifest& manifest, const std::string& route,
                                    torch::inductor::AOTIModelPackageLoader& loader, const std::string& runtime,
                                    const c10::Device& device) {
  if (route == "model") return std::make_unique<ModelScorer>(loader);
  if (!manifest.json.contains("step_program")) {
    throw ReplayError(kUnusable, "--route " + route + " needs an artifact with a step program (step.pt2): build it " +
                                     "with --step-program");
  }
  const auto package = manifest.root / "step.pt2";  // listed in the manifest, so its sha256 was checked
  check_shared_objects(package);
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> step;
  try {
    step = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package.string(), "model",
                                                                     /*run_single_threaded=*/true, 1);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    throw ReplayError(kUnusable, "cannot load step.pt2: " + what.substr(0, what.find('\n')));
  }
  auto scorer = std::make_unique<StepScorer>(std::move(step), device, route == "graphs");
  if (scorer->runtime() != runtime) {
    throw ReplayError(kUnusable, "step.pt2 is not this artifact's step program (its runtime is " + scorer->runtime() +
                                     ", model.pt2's " + runtime + ")");
  }
  return scorer;
}

// Every thread replays the whole trace through the shared loader and runtime. Cache states
// interleave, but cached == recompute holds for any state, so each output must still match.
void replay_concurrently(const Replay& replay, int num_threads, std::vector<StepResult>& results) {
  const auto& steps = replay.steps;
  std::vector<std::vector<StepResult>> per_thread(num_threads, std::vector<StepResult>(steps.size()));
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> errors(num_threads);
  for (int t = 0; t < num_threads; ++t) {
    workers.emplace_back([&, t] {
      try {
        replay_pass(replay, per_thread[t], /*count_cache=*/false);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (auto& w : workers) w.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (const auto& thread_results : per_thread) {
    for (size_t i = 0; i < steps.size(); ++i) {
      auto& r = results[i];
      const auto& t = thread_results[i];
      r.batch_size = t.batch_size;
      merge_worst(r.vs_cached, t.vs_cached);
      merge_worst(r.vs_full, t.vs_full);
      merge_worst(r.vs_reference, t.vs_reference);
      r.latencies_ms.insert(r.latencies_ms.end(), t.latencies_ms.begin(), t.latencies_ms.end());
    }
  }
}

nlohmann::json make_report(const Manifest& manifest, const Options& options, int files_checked, double atol,
                           double rtol, const std::vector<StepResult>& results) {
  nlohmann::json report = {{"artifact", manifest.root.string()},
                           {"runner", "cpp"},
                           {"files_checked", files_checked},
                           {"atol", atol},
                           {"rtol", rtol},
                           {"repeat", options.repeat},
                           {"threads", options.threads},
                           {"steps", nlohmann::json::array()}};
  bool all_passed = true;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const bool passed = r.vs_cached.passed && r.vs_full.passed && r.vs_reference.passed;
    all_passed = all_passed && passed;
    report["steps"].push_back({{"index", i},
                               {"description", manifest.steps[i].description},
                               {"batch_size", r.batch_size},
                               {"vs_cached", to_json(r.vs_cached)},
                               {"vs_full", to_json(r.vs_full)},
                               {"vs_reference", to_json(r.vs_reference)},
                               {"hit_tokens", r.hit_tokens},
                               {"recomputed_tokens", r.recomputed_tokens},
                               {"latency_ms", percentile(r.latencies_ms, 0.5)},
                               {"latency_p50_ms", percentile(r.latencies_ms, 0.5)},
                               {"latency_p99_ms", percentile(r.latencies_ms, 0.99)},
                               {"passed", passed}});
  }
  report["passed"] = all_passed;
  return report;
}

int run(const Options& options) {
  const auto manifest = read_manifest(options.artifact);
  const int files_checked = check_files(manifest);
  // Before any of the artifact's machine code is loaded: code built for a feature this CPU lacks
  // can die of SIGILL as soon as it runs.
  if (const auto missing = missing_cpu_feature(manifest.json.value("isa", nlohmann::json::object()));
      !missing.empty()) {
    throw ReplayError(kUnusable, missing);
  }
  load_libraries(manifest, options);
  // Before the package is loaded: its GPU kernels are compiled for the build GPU's architecture.
  const auto manifest_device = manifest.json.value("device", std::string("cpu"));
  if (c10::Device(manifest_device).is_cuda()) {
    const auto info = call_op("kvexport::gpu_info", {c10::Device(manifest_device)});
    if (const auto wrong = wrong_gpu(manifest.json.value("isa", nlohmann::json::object()), manifest_device,
                                     info.at(0).toStringRef(), info.at(1).toStringRef());
        !wrong.empty()) {
      throw ReplayError(kUnusable, wrong);
    }
  }
  const double atol = options.atol.value_or(manifest.atol), rtol = options.rtol.value_or(manifest.rtol);

  PrivateTempDir temp_dir;
  const auto loader = load_package(manifest, options.threads);
  auto metadata = loader->get_metadata();
  for (const char* key :
       {"kvexport.runtime_name", "kvexport.signature", "kvexport.runtime_config", "kvexport.device"}) {
    if (!metadata.count(key)) throw ReplayError(kUnusable, std::string("model.pt2 lacks the metadata ") + key);
  }
  check_manifest_against_package(manifest, metadata);
  const std::string runtime = metadata.at("kvexport.runtime_name");
  const auto signature = nlohmann::json::parse(metadata.at("kvexport.signature")).get<std::vector<std::string>>();
  // The package names its device; the runtime lives there (requests stay on the host).
  const c10::Device device(metadata.at("kvexport.device"));
  call_op("kvexport::create_runtime", {runtime, metadata.at("kvexport.runtime_config"), device});
  if (options.remote) {
    attach_remote(runtime,
                  options.remote_password_file
                      ? url_with_password(*options.remote, read_password_file(*options.remote_password_file))
                      : *options.remote,
                  options.remote_write);
  }
  const auto scorer = make_scorer(manifest, options.route, *loader, runtime, device);
  Replay replay{*scorer, runtime, load_trace(manifest, signature), {}, atol, rtol};
  if (options.hostile) replay.hostile = load_hostile(*options.hostile, signature);

  std::vector<StepResult> results(replay.steps.size());
  for (int pass = 0; pass < options.repeat; ++pass) {
    call_op("kvexport::reset_runtime", {runtime});
    if (options.threads == 1) {
      replay_pass(replay, results, /*count_cache=*/pass == 0);
    } else {
      replay_concurrently(replay, options.threads, results);
    }
  }
  if (options.remote && !call_op("kvexport::flush_remote", {runtime, kRemoteFlushTimeoutMs})[0].toBool()) {
    std::fprintf(stderr, "warning: the remote tier (--remote): writes still queued after %lld ms were dropped\n",
                 static_cast<long long>(kRemoteFlushTimeoutMs));
  }
  auto report = make_report(manifest, options, files_checked, atol, rtol, results);
  report["counters"] = runtime_stats(runtime);
  print_report(report);
  if (options.json) {
    std::ofstream out(*options.json);
    out << report.dump(2) << "\n";
    if (!out) throw ReplayError(kUnusable, "cannot write " + options.json->string());
  }
  return report["passed"].get<bool>() ? kPass : kMismatch;
}

// An error's first line: the harness reports one line, and torch's messages can run to several.
std::string first_line(const char* text) {
  const std::string all(text);
  return all.substr(0, all.find('\n'));
}

}  // namespace
}  // namespace kvexport::replay

int main(int argc, char** argv) {
  using namespace kvexport::replay;
  try {
    const auto options = parse_options(argc, argv);
    StderrFilter quiet_aoti_errors;
    return run(options);
  } catch (const ReplayError& e) {
    std::fprintf(e.code == kPass ? stdout : stderr, "%s%s\n", e.code == kPass ? "" : "error: ", e.what());
    return e.code;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", first_line(e.what_without_backtrace()).c_str());
    return kUnusable;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", first_line(e.what()).c_str());
    return kUnusable;
  }
}
