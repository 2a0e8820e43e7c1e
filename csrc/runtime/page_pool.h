// The device tier's free pages. Which user to evict when it runs dry is the user table's business.
#pragma once

#include <cstdint>
#include <vector>

namespace kvexport::runtime {

class PagePool {
 public:
  explicit PagePool(int64_t num_pages) : num_pages_(num_pages) { reset(); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_used() const { return num_pages_ - num_free(); }
  // The last `count` free pages; the caller checked num_free() >= count.
  std::vector<int64_t> allocate(int64_t count);
  void release(const std::vector<int64_t>& pages) { free_.insert(free_.end(), pages.begin(), pages.end()); }
  void release(int64_t page) { free_.push_back(page); }
  // Every page free, handed out from page 0 up.
  void reset();

 private:
  int64_t num_pages_;
  std::vector<int64_t> free_;
};

}  // namespace kvexport::runtime
