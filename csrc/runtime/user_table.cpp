#include "runtime/user_table.h"

#include <algorithm>
#include <utility>

namespace kvexport::runtime {

UserEntry* UserTable::find(int64_t user_id) {
  auto it = users_.find(user_id);
  return it == users_.end() ? nullptr : &it->second;
}

UserEntry& UserTable::touch(int64_t user_id) {
  auto& entry = users_[user_id];
  entry.last_used = ++clock_;
  return entry;
}

std::optional<int64_t> UserTable::least_recent(const std::unordered_set<int64_t>& keep) const {
  auto victim = users_.end();
  for (auto it = users_.begin(); it != users_.end(); ++it) {
    if (keep.count(it->first)) continue;
    if (victim == users_.end() || it->second.last_used < victim->second.last_used) victim = it;
  }
  if (victim == users_.end()) return std::nullopt;
  return victim->first;
}

std::optional<UserEntry> UserTable::remove(int64_t user_id) {
  auto it = users_.find(user_id);
  if (it == users_.end()) return std::nullopt;
  UserEntry entry = std::move(it->second);
  users_.erase(it);
  return entry;
}

std::vector<int64_t> UserTable::lru_order() const {
  std::vector<std::pair<int64_t, int64_t>> by_age;
  for (const auto& [user, entry] : users_) by_age.emplace_back(entry.last_used, user);
  std::sort(by_age.begin(), by_age.end());
  std::vector<int64_t> users;
  for (const auto& [age, user] : by_age) users.push_back(user);
  return users;
}

void UserTable::clear() {
  users_.clear();
  clock_ = 0;
}

}  // namespace kvexport::runtime
