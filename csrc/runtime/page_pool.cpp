#include "runtime/page_pool.h"

#include <numeric>
#include <stdexcept>
#include <string>

namespace kvexport::runtime {

std::vector<int64_t> PagePool::allocate(int64_t count) {
  if (count > num_free()) {
    throw std::logic_error("kvexport bug: allocating " + std::to_string(count) + " pages with " +
                           std::to_string(num_free()) + " free");
  }
  std::vector<int64_t> pages(free_.end() - count, free_.end());
  free_.resize(free_.size() - count);
  return pages;
}

void PagePool::reset() {
  free_.resize(num_pages_);
  // Pages are handed out from the back: page 0 first.
  std::iota(free_.rbegin(), free_.rend(), 0);
}

}  // namespace kvexport::runtime
