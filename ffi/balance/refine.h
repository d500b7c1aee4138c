// The pairwise refinement of jodc/balance/refine.py (refine_by_swaps after its argument checks) in C++: the same
// exchanges chosen in the same order, with the same IEEE-754 double arithmetic (part sums exactly rounded like
// Python's math.fsum), so the partitions are identical to the Python reference's. module.cc binds it.
#pragma once

#include <cstdint>
#include <vector>

namespace jodc::balance {

// The exactly rounded sum of `values` (what Python's math.fsum returns for finite inputs).
double ExactSum(const std::vector<double>& values);

// Refines `parts` in place (each part's indices end ascending). `has_capacity` false: `size` and `capacity` are
// ignored. The constants are refine.py's MAX_PAIR_TABLE and LOWER_BOUND_TOLERANCE, passed in so that one place
// defines them.
void RefineBySwaps(const std::vector<double>& cost, const std::vector<double>& size, bool has_capacity,
                   double capacity, bool allow_moves, int64_t max_group, int64_t max_rounds, int64_t max_pair_table,
                   double lower_bound_tolerance, std::vector<std::vector<int64_t>>* parts);

}  // namespace jodc::balance
