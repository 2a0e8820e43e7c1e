// The runtime's named counters: the one statement of their names and order (kvexport::stat_names).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvexport::runtime {

struct RemoteCounters {
  int64_t hits = 0;               // users onboarded from the remote tier
  int64_t hit_tokens = 0;         // of hit_tokens, served from remote entries
  int64_t misses = 0;             // remote reads that found no entry or failed
  int64_t rejected_format = 0;    // entries malformed, truncated, of another version or shape
  int64_t rejected_checksum = 0;  // entries whose bytes do not match their checksum
  int64_t rejected_runtime = 0;   // entries written by another runtime name
  int64_t rejected_prefix = 0;    // entries sharing no prefix with the request's tokens
  int64_t writes = 0;             // entries stored
  int64_t write_drops = 0;        // entries not queued because the writer's queue was full
  int64_t errors = 0;             // reads and writes the server failed (or skipped while reconnecting)
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
  int64_t reads = 0;    // reads that reached the server
  int64_t read_us = 0;  // their total latency
  int64_t read_us_max = 0;
  int64_t connected = 0;   // gauge: 1 while the tier's reads have a live connection
  int64_t reconnects = 0;  // connections the reads re-established after losing the server

  int64_t rejected() const { return rejected_format + rejected_checksum + rejected_runtime + rejected_prefix; }
  // Adds another set (one tier's counts into the runtime's); the maximum stays a maximum.
  RemoteCounters& operator+=(const RemoteCounters& other);
};

struct Counters {
  int64_t lookups = 0;             // users looked up
  int64_t hit_tokens = 0;          // prefix tokens served from the cache
  int64_t recomputed_tokens = 0;   // prefix tokens computed by a request
  int64_t device_evictions = 0;    // users evicted from the device tier
  int64_t offloads = 0;            // of those, users stored in the offload tier
  int64_t onboards = 0;            // users brought back from an offload tier
  int64_t host_evictions = 0;      // users the first offload tier let go (to the next tier, if any)
  int64_t prefix_truncations = 0;  // users whose stored tokens diverged from the request
  int64_t stalled_batches = 0;     // batches released to another request after stalling
  int64_t busy_host_requests = 0;  // CPU requests that ran on fewer threads: other work held the CPUs
  RemoteCounters remote;
};

// Occupancy gauges, read when the stats are taken.
struct Occupancy {
  int64_t device_pages_used = 0;
  int64_t device_users = 0;
  int64_t host_pages_used = 0;
  int64_t host_users = 0;
};

// The names of the stats op's values, in order: the one list every host reads (kvexport::stat_names).
const std::vector<std::string>& stat_names();
// Counters and gauges in stat_names() order.
std::vector<int64_t> stats_vector(const Counters& c, const Occupancy& o);

}  // namespace kvexport::runtime
