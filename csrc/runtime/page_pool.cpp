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
  for (auto page : pages) is_free_[page] = false;
  return pages;
}

void PagePool::release(const std::vector<int64_t>& pages) {
  for (size_t i = 0; i < pages.size(); ++i) {
    const int64_t page = pages[i];
    const bool outside = page < 0 || page >= num_pages_;
    if (outside || is_free_[page]) {
      for (size_t j = 0; j < i; ++j) is_free_[pages[j]] = false;  // nothing released
      throw std::logic_error(
          "kvexport bug: releasing page " + std::to_string(page) + ", which is " +
          (outside ? "outside the pool of " + std::to_string(num_pages_) + " pages" : std::string("free already")));
    }
    is_free_[page] = true;
  }
  free_.insert(free_.end(), pages.begin(), pages.end());
}

void PagePool::reset() {
  free_.resize(num_pages_);
  // Pages are handed out from the back: page 0 first.
  std::iota(free_.rbegin(), free_.rend(), 0);
  is_free_.assign(num_pages_, true);
}

}  // namespace kvexport::runtime
