// Step 2 of jodc/balance/partition.py's _free_partition (small instances still above the bound after the fast
// path) in one C++ call: re-split the fast path's assignment, then for every fill target fill, descend and re-split,
// keeping the lightest, until the heaviest part reaches the target. The same steps as the Python loop, each the
// compiled op the Python step would call (Descend, ResplitHeaviest, FillParts), so the result is identical; one call
// instead of ~20 spares the Python overhead that dominated the golden setting's planning time. module.cc binds it.
#pragma once

#include <cstdint>
#include <vector>

namespace jodc::balance {

struct SmallStageOptions {
  double bound;            // the lower bound
  double target;           // bound * (1 + BOUND_TOLERANCE), as Python rounds it: stop once the heaviest is below
  double tol;              // descent.py's _prepare: 1e-12 * max(fsum(cost), 1e-300)
  int64_t rounds;          // descend's max_rounds
  bool small;              // descend's small (n <= SMALL_ITEMS)
  double bound_tolerance;  // descent.py's BOUND_TOLERANCE
  int64_t partner_parts;   // descent.py's PARTNER_PARTS
  int64_t resplit_rounds;  // partition.py's RESPLIT_ROUNDS
  int64_t resplit_items;   // descent.py's RESPLIT_ITEMS
  int64_t fill_others;     // partition.py's FILL_OTHERS
  int64_t max_subsets;     // fill.py's MAX_SUBSETS
};

// Replaces `assign` (the fast path's assignment, item -> part) by the lightest found; returns whether its heaviest
// part is within `target`. `fill_targets`: bound * (1 + step) for partition.py's FILL_STEPS (empty: no fills).
bool SmallStage(const std::vector<double>& cost, int64_t k, const std::vector<double>& fill_targets,
                const SmallStageOptions& options, std::vector<int64_t>* assign);

}  // namespace jodc::balance
