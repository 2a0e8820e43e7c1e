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
  bool is_free(int64_t page) const { return page >= 0 && page < num_pages_ && is_free_[page]; }
  // The last `count` free pages; the caller checked num_free() >= count.
  std::vector<int64_t> allocate(int64_t count);
  // Gives pages back; the next allocate hands out the last released first. A page outside the pool
  // or already free (released twice) is a kvexport bug: std::logic_error naming it, nothing released.
  void release(const std::vector<int64_t>& pages);
  void release(int64_t page) { release(std::vector<int64_t>{page}); }
  // Every page free, handed out from page 0 up.
  void reset();

 private:
  int64_t num_pages_;
  std::vector<int64_t> free_;
  std::vector<bool> is_free_;  // [num_pages_]: whether free_ holds the page
};

}  // namespace kvexport::runtime
