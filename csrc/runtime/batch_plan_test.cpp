// The batch plan: where each new row's k/v goes, which cached keys it reads, its tiles, and the
// step program's padded layout.
#include "runtime/batch_plan.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace kvexport::runtime {
namespace {

using Values = std::vector<int64_t>;

Values values_of(const at::Tensor& tensor) {
  const auto flat = tensor.to(at::kLong).contiguous().view(-1);
  return Values(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel());
}

// Two users at page size 2: user 10 with 5 tokens, 2 of them cached, on pages 4, 1, 6, and 2
// candidates; user 20 with 3 tokens, none cached, on pages 0, 3, and 1 candidate.
struct TwoUsers {
  static constexpr int64_t kPageSize = 2;
  BatchPlan plan;
  Values pages_10{4, 1, 6}, pages_20{0, 3};
  std::vector<const Values*> user_pages{&pages_10, &pages_20};
  Values token_lengths{5, 3}, num_candidates{2, 1};
  TwoUsers() {
    plan.user_ids = {10, 20};
    plan.cached_lengths = {2, 0};
  }
};

TEST(BatchPlan, LaysOutCandidatesThenNewPrefixRowsUserByUser) {
  TwoUsers batch;
  const auto new_tokens = build_plan_tensors(batch.plan, batch.user_pages, batch.token_lengths, batch.num_candidates,
                                             TwoUsers::kPageSize, at::kCPU);
  const auto& plan = batch.plan;
  EXPECT_EQ(plan.num_candidate_rows, 3);
  EXPECT_EQ(plan.num_new_prefix_rows, 6);
  EXPECT_EQ(values_of(plan.page_table), (Values{4, 1, 6, 0, 3, 0}));
  EXPECT_EQ(plan.page_table.sizes().vec(), (Values{2, 3}));
  EXPECT_EQ(values_of(plan.row_user), (Values{0, 0, 1, 0, 0, 0, 1, 1, 1}));
  // Candidates read their user's whole prefix; a prefix row reads the keys up to its own.
  EXPECT_EQ(values_of(plan.row_keys), (Values{5, 5, 3, 3, 4, 5, 1, 2, 3}));
  EXPECT_EQ(values_of(plan.row_candidate), (Values{1, 1, 1, 0, 0, 0, 0, 0, 0}));
  // Slot of position p: page * 2 * page_size + p % page_size (k rows); v rows a page_size later.
  EXPECT_EQ(values_of(plan.write_slots), (Values{4, 5, 24, 0, 1, 12}));
  EXPECT_EQ(values_of(plan.value_slots), (Values{6, 7, 26, 2, 3, 14}));
  // Each new prefix row's index in the request's token ids, then its position in its user's prefix.
  EXPECT_EQ(values_of(new_tokens), (Values{2, 3, 4, 5, 6, 7, 2, 3, 4, 0, 1, 2}));
  EXPECT_EQ(values_of(plan.row_order), (Values{0, 1, 3, 4, 5, 2, 6, 7, 8}));
  EXPECT_EQ(values_of(plan.tiles), (Values{0, 0, 5, 1, 5, 4}));
  EXPECT_EQ(plan.max_row_keys, 5);
  EXPECT_EQ(plan.max_tile_rows, 5);
}

TEST(BatchPlan, ContextualRowsThatSeeThePrefixReadAllOfIt) {
  TwoUsers batch;
  batch.plan.context_rows_see_prefix = 3;
  build_plan_tensors(batch.plan, batch.user_pages, batch.token_lengths, batch.num_candidates, TwoUsers::kPageSize,
                     at::kCPU);
  EXPECT_EQ(values_of(batch.plan.row_keys), (Values{5, 5, 3, 5, 4, 5, 3, 3, 3}));
}

TEST(BatchPlan, AStepPlanPadsEveryPartToItsBucket) {
  TwoUsers batch;
  const Values token_ids{100, 101, 102, 103, 104, 200, 201, 202}, candidate_ids{7, 8, 9};
  const int64_t trash_slot = 7 * 2 * TwoUsers::kPageSize;  // page 7 belongs to no user
  const auto step = build_step_plan(batch.plan, batch.user_pages, batch.token_lengths, batch.num_candidates, token_ids,
                                    candidate_ids, TwoUsers::kPageSize, 4, trash_slot, at::kCPU);
  const auto& layout = step.layout;
  EXPECT_EQ(layout.to_vector(), (Values{16, 16, 2, 4, 3, 3, StepLayout::kStepAlign}));
  EXPECT_EQ(layout.offsets(), (Values{0, 16, 32, 48, 64, 72, 104, 136, 168, 184, 200, 232}));
  EXPECT_EQ(step.staged.numel(), layout.numel());
  // The first `count` values of part `index` of the staged buffer, and its last one.
  const auto head = [&](int index, int64_t count) {
    const int64_t* start = step.staged.data_ptr<int64_t>() + layout.offsets()[index];
    return Values(start, start + count);
  };
  const auto last = [&](int index) {
    return step.staged.data_ptr<int64_t>()[layout.offsets()[index] + layout.sizes()[index] - 1];
  };
  EXPECT_EQ(head(0, 4), (Values{7, 8, 9, 0}));
  EXPECT_EQ(head(2, 7), (Values{102, 103, 104, 200, 201, 202, 0}));
  EXPECT_EQ(head(8, 7), (Values{4, 5, 24, 0, 1, 12, trash_slot}));
  EXPECT_EQ(last(8), trash_slot);
  // The real rows grouped by user (prefix rows from row 16, the padded candidates' end), then padding.
  EXPECT_EQ(head(10, 10), (Values{0, 1, 16, 17, 18, 2, 19, 20, 21, 3}));
  EXPECT_EQ(last(10), 31);
  EXPECT_EQ(head(11, 9), (Values{0, 0, 5, 1, 5, 4, 0, 0, 0}));
}

TEST(BatchPlan, BucketsGrowByQuarterOctaves) {
  EXPECT_EQ(bucket_size(1, kMinStepRows), 16);
  EXPECT_EQ(bucket_size(16, kMinStepRows), 16);
  EXPECT_EQ(bucket_size(17, kMinStepRows), 20);
  EXPECT_EQ(bucket_size(33, kMinStepRows), 40);
  EXPECT_EQ(bucket_size(100, kMinStepRows), 112);
  EXPECT_EQ(bucket_size(5, 1), 5);
}

TEST(BatchPlan, UserTilesGroupRowsByUserInOrder) {
  const auto [row_order, tiles] = user_tiles({1, 0, 1, 1}, 2);
  EXPECT_EQ(row_order, (Values{1, 0, 2, 3}));
  EXPECT_EQ(tiles, (Values{0, 0, 1, 1, 1, 2, 1, 3, 1}));
  EXPECT_EQ(widest_tile(tiles), 2);
  EXPECT_EQ(widest_tile({}), 0);
}

TEST(BatchPlan, UserTilesRefuseANegativeBatchIndex) {
  try {
    user_tiles({0, -2}, 2);
    FAIL() << "user_tiles took batch index -2";
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(std::string(error.what()), "user_tiles: negative batch index -2");
  }
}

TEST(BatchPlan, AStepLayoutOfAnotherVersionIsRefused) {
  const StepLayout layout{16, 32, 4, 3, 2, 5};
  EXPECT_EQ(StepLayout::from_vector(layout.to_vector()).to_vector(), layout.to_vector());
  try {
    StepLayout::from_vector({16, 32, 4, 3, 2, 5});
    FAIL() << "a layout of six values was taken";
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(std::string(error.what()),
              "begin_step's layout is not this version's (6 values): the op library was built from other kvexport "
              "sources");
  }
}

}  // namespace
}  // namespace kvexport::runtime
