// The device tier's users: each one's pages, the token ids its cache was computed from, and its
// place in the LRU order.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kvexport::runtime {

struct UserEntry {
  std::vector<int64_t> pages;
  std::vector<int64_t> token_ids;
  int64_t last_used = 0;
};

class UserTable {
 public:
  using Map = std::unordered_map<int64_t, UserEntry>;

  UserEntry* find(int64_t user_id);
  // The user's entry, created empty if absent, marked most recently used.
  UserEntry& touch(int64_t user_id);
  // The least recently used user outside `keep`, if any.
  std::optional<int64_t> least_recent(const std::unordered_set<int64_t>& keep) const;
  // Removes a user, if present, and returns its entry.
  std::optional<UserEntry> remove(int64_t user_id);
  std::vector<int64_t> lru_order() const;  // least recently used first
  int64_t size() const { return static_cast<int64_t>(users_.size()); }
  void clear();

 private:
  Map users_;
  int64_t clock_ = 0;
};

}  // namespace kvexport::runtime
