// The makespan descent of jodc/balance/descent.py (descend after its argument preparation) in C++: the same
// exchanges evaluated with the same IEEE-754 double operations, the first best candidate in numpy's row-major table
// order, the same (value, kind) choice between exchange kinds and the same sum updates, so the assignments are
// identical to the Python reference's. module.cc binds it.
#pragma once

#include <cstdint>
#include <vector>

namespace jodc::balance {

// Lowers the heaviest part of `assign` (item -> part, updated in place). `bound`, `tol` and `small` as descend
// computes them; `bound_tolerance` and `partner_parts` are descent.py's BOUND_TOLERANCE and PARTNER_PARTS.
void Descend(const std::vector<double>& cost, int64_t k, int64_t max_rounds, double bound, double tol, bool small,
             bool equal_counts, double bound_tolerance, int64_t partner_parts, std::vector<int64_t>* assign);

}  // namespace jodc::balance
