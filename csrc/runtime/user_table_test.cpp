// UserTable: entries by user, and the least recently used order eviction follows.
#include "runtime/user_table.h"

#include <gtest/gtest.h>

#include <optional>
#include <unordered_set>
#include <vector>

namespace kvexport::runtime {
namespace {

using Users = std::vector<int64_t>;

TEST(UserTable, TouchCreatesAnEmptyEntryOnce) {
  UserTable table;
  EXPECT_EQ(table.find(7), nullptr);
  UserEntry& entry = table.touch(7);
  EXPECT_TRUE(entry.pages.empty() && entry.token_ids.empty());
  entry.pages = {3, 1};
  EXPECT_EQ(&table.touch(7), &entry);
  EXPECT_EQ(table.find(7), &entry);
  EXPECT_EQ(table.find(7)->pages, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(table.size(), 1);
}

TEST(UserTable, OrdersUsersLeastRecentlyUsedFirst) {
  UserTable table;
  for (int64_t user : {1, 2, 3}) table.touch(user);
  EXPECT_EQ(table.lru_order(), (Users{1, 2, 3}));
  table.touch(1);
  EXPECT_EQ(table.lru_order(), (Users{2, 3, 1}));
  EXPECT_EQ(table.find(1)->last_used, 4);
}

TEST(UserTable, TheLeastRecentUserSkipsThoseKept) {
  UserTable table;
  for (int64_t user : {1, 2, 3}) table.touch(user);
  EXPECT_EQ(table.least_recent({}), std::optional<int64_t>(1));
  EXPECT_EQ(table.least_recent({1}), std::optional<int64_t>(2));
  EXPECT_EQ(table.least_recent({1, 2}), std::optional<int64_t>(3));
  EXPECT_EQ(table.least_recent({1, 2, 3}), std::nullopt);
  EXPECT_EQ(UserTable().least_recent({}), std::nullopt);
}

TEST(UserTable, RemoveHandsBackTheEntryOnce) {
  UserTable table;
  table.touch(1);
  table.touch(2).token_ids = {10, 11, 12};
  const auto removed = table.remove(2);
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->token_ids, (std::vector<int64_t>{10, 11, 12}));
  EXPECT_EQ(table.remove(2), std::nullopt);
  EXPECT_EQ(table.find(2), nullptr);
  EXPECT_EQ(table.lru_order(), (Users{1}));
}

TEST(UserTable, ClearForgetsUsersAndRestartsTheClock) {
  UserTable table;
  for (int64_t user : {1, 2}) table.touch(user);
  table.clear();
  EXPECT_EQ(table.size(), 0);
  EXPECT_TRUE(table.lru_order().empty());
  EXPECT_EQ(table.touch(5).last_used, 1);
}

}  // namespace
}  // namespace kvexport::runtime
