// The item-wise branch-and-bound search of jodc/balance/search.py (_search_free and _search_general) in C++: the
// same nodes in the same order, the same IEEE-754 double arithmetic in the same order and the same node budget, so
// the plans are identical to the Python reference's. No XLA or Python types: module.cc binds it.
#pragma once

#include <cstdint>
#include <vector>

namespace jodc::balance {

// Inputs exactly as search.py's loops take them (items ordered heaviest first). `free_search` selects
// _search_free (no count or size constraint), else _search_general. Returns true and fills `assignment`
// (position -> part) when a partition lighter than `best_max` was found.
bool SearchPartition(const std::vector<double>& ordered_cost, const std::vector<double>& ordered_size,
                     const std::vector<double>& remaining_after, int64_t k, double best_max, double tolerance,
                     double lower_bound, int64_t node_budget, bool free_search, bool equal_sizes, int64_t count_cap,
                     int64_t count_floor, double cap, std::vector<int64_t>* assignment);

}  // namespace jodc::balance
