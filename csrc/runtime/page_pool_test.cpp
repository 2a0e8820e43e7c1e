// PagePool: which pages it hands out, in which order, and the releases it refuses.
#include "runtime/page_pool.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace kvexport::runtime {
namespace {

using Pages = std::vector<int64_t>;

// The message of the std::logic_error `call` throws ("" when it throws none).
template <typename F>
std::string logic_error_of(F call) {
  try {
    call();
  } catch (const std::logic_error& error) {
    return error.what();
  }
  return "";
}

TEST(PagePool, HandsOutPagesFromZeroUp) {
  PagePool pool(4);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.allocate(3), (Pages{2, 1, 0}));
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.num_used(), 3);
  EXPECT_FALSE(pool.is_free(0));
  EXPECT_TRUE(pool.is_free(3));
  EXPECT_EQ(pool.allocate(1), (Pages{3}));
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(PagePool, HandsOutTheLastReleasedPageFirst) {
  PagePool pool(4);
  pool.allocate(4);
  pool.release(Pages{2, 0});
  pool.release(3);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.allocate(1), (Pages{3}));
  EXPECT_EQ(pool.allocate(2), (Pages{2, 0}));
  EXPECT_EQ(pool.num_used(), 4);
}

TEST(PagePool, RefusesToReleaseAFreePage) {
  PagePool pool(4);
  pool.allocate(2);  // pages 1 and 0
  EXPECT_EQ(logic_error_of([&] { pool.release(3); }), "kvexport bug: releasing page 3, which is free already");
  pool.release(1);
  EXPECT_EQ(logic_error_of([&] { pool.release(1); }), "kvexport bug: releasing page 1, which is free already");
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.allocate(1), (Pages{1}));
}

TEST(PagePool, RefusesAPageReleasedTwiceInOneCallAndReleasesNoneOfIt) {
  PagePool pool(4);
  pool.allocate(4);
  EXPECT_EQ(logic_error_of([&] {
              pool.release(Pages{2, 0, 2});
            }),
            "kvexport bug: releasing page 2, which is free already");
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_FALSE(pool.is_free(2));
  EXPECT_FALSE(pool.is_free(0));
  pool.release(Pages{2, 0});  // both still in use: released now
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(PagePool, RefusesAPageOutsideThePool) {
  PagePool pool(4);
  pool.allocate(4);
  EXPECT_EQ(logic_error_of([&] { pool.release(4); }),
            "kvexport bug: releasing page 4, which is outside the pool of 4 pages");
  EXPECT_EQ(logic_error_of([&] { pool.release(-1); }),
            "kvexport bug: releasing page -1, which is outside the pool of 4 pages");
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_FALSE(pool.is_free(4));
}

TEST(PagePool, RefusesToAllocateMorePagesThanAreFree) {
  PagePool pool(4);
  pool.allocate(1);
  EXPECT_EQ(logic_error_of([&] { pool.allocate(4); }), "kvexport bug: allocating 4 pages with 3 free");
  EXPECT_EQ(pool.num_free(), 3);
}

TEST(PagePool, ResetFreesEveryPageInItsFirstOrder) {
  PagePool pool(3);
  pool.allocate(2);
  pool.release(1);
  pool.reset();
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.allocate(3), (Pages{2, 1, 0}));
}

}  // namespace
}  // namespace kvexport::runtime
