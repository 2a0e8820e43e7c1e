#include "runtime/counters.h"

#include <algorithm>

namespace kvexport::runtime {

RemoteCounters& RemoteCounters::operator+=(const RemoteCounters& other) {
  hits += other.hits;
  hit_tokens += other.hit_tokens;
  misses += other.misses;
  rejected_format += other.rejected_format;
  rejected_checksum += other.rejected_checksum;
  rejected_runtime += other.rejected_runtime;
  rejected_prefix += other.rejected_prefix;
  writes += other.writes;
  write_drops += other.write_drops;
  errors += other.errors;
  bytes_in += other.bytes_in;
  bytes_out += other.bytes_out;
  reads += other.reads;
  read_us += other.read_us;
  read_us_max = std::max(read_us_max, other.read_us_max);
  connected += other.connected;
  reconnects += other.reconnects;
  return *this;
}

const std::vector<std::string>& stat_names() {
  // New names are appended: hosts may read values by position.
  static const std::vector<std::string> names = {"lookups",
                                                 "hit_tokens",
                                                 "recomputed_tokens",
                                                 "device_evictions",
                                                 "offloads",
                                                 "onboards",
                                                 "host_evictions",
                                                 "prefix_truncations",
                                                 "stalled_batches",
                                                 "device_pages_used",
                                                 "device_users",
                                                 "host_pages_used",
                                                 "host_users",
                                                 "remote_hits",
                                                 "remote_hit_tokens",
                                                 "remote_misses",
                                                 "remote_rejected_format",
                                                 "remote_rejected_checksum",
                                                 "remote_rejected_runtime",
                                                 "remote_rejected_prefix",
                                                 "remote_writes",
                                                 "remote_write_drops",
                                                 "remote_errors",
                                                 "remote_bytes_in",
                                                 "remote_bytes_out",
                                                 "remote_reads",
                                                 "remote_read_us",
                                                 "remote_read_us_max",
                                                 "remote_connected",
                                                 "remote_rejected",
                                                 "remote_reconnects",
                                                 "busy_host_requests"};
  return names;
}

std::vector<int64_t> stats_vector(const Counters& c, const Occupancy& o) {
  const auto& r = c.remote;
  return {c.lookups,
          c.hit_tokens,
          c.recomputed_tokens,
          c.device_evictions,
          c.offloads,
          c.onboards,
          c.host_evictions,
          c.prefix_truncations,
          c.stalled_batches,
          o.device_pages_used,
          o.device_users,
          o.host_pages_used,
          o.host_users,
          r.hits,
          r.hit_tokens,
          r.misses,
          r.rejected_format,
          r.rejected_checksum,
          r.rejected_runtime,
          r.rejected_prefix,
          r.writes,
          r.write_drops,
          r.errors,
          r.bytes_in,
          r.bytes_out,
          r.reads,
          r.read_us,
          r.read_us_max,
          r.connected,
          r.rejected(),
          r.reconnects,
          c.busy_host_requests};
}

}  // namespace kvexport::runtime
