// The greedy fill of jodc/balance/fill.py (fill_parts) in C++: parts opened by the heaviest remaining item, each
// completed by the first subset (by size, then in itertools.combinations' order) of at most the table size of the
// remaining items that fit whose sum, added item by item, comes closest to the target from below, so the assignments
// are identical to the Python reference's. module.cc binds it; small.cc calls it.
#pragma once

#include <cstdint>
#include <vector>

namespace jodc::balance {

// The assignment (item -> part) of a fill toward `target`; `max_others` and `max_subsets` are fill_parts' argument
// and fill.py's MAX_SUBSETS.
std::vector<int64_t> FillParts(const std::vector<double>& cost, int64_t k, double target, int64_t max_others,
                               int64_t max_subsets);

}  // namespace jodc::balance
