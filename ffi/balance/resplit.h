// The two-part re-split of jodc/balance/descent.py (resplit_heaviest after its argument preparation) in C++: every
// subset of the heaviest part's and one other part's items, its side summed bit by bit in subset_sums' fixed order,
// the first lightest heavier side in numpy's row-major order, part sums exactly rounded (math.fsum), so the
// assignments are identical to the Python reference's. module.cc binds it; small.cc calls it.
#pragma once

#include <cstdint>
#include <vector>

namespace jodc::balance {

// Re-splits the heaviest part of `assign` (item -> part, updated in place) with another part, at most `max_rounds`
// times. `bound` and `tol` as resplit_heaviest computes them; `bound_tolerance` and `resplit_items` are descent.py's
// BOUND_TOLERANCE and RESPLIT_ITEMS (at most 24: 2^items subset sums are held in memory).
void ResplitHeaviest(const std::vector<double>& cost, int64_t k, int64_t max_rounds, double bound, double tol,
                     bool equal_counts, double bound_tolerance, int64_t resplit_items, std::vector<int64_t>* assign);

}  // namespace jodc::balance
