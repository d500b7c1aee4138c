// See small.h. Mirrors the loop of jodc/balance/partition.py's _free_partition step by step; keep them in
// step.
#include "balance/small.h"

#include <cstddef>

#include "balance/descent.h"
#include "balance/fill.h"
#include "balance/resplit.h"

namespace jodc::balance {
namespace {

// partition.py's _span: the heaviest part, its sum in item order (np.bincount(weights=)).
double Span(const std::vector<double>& cost, const std::vector<int64_t>& assign, int64_t k) {
  std::vector<double> sums(k, 0.0);
  for (std::size_t i = 0; i < cost.size(); ++i) sums[assign[i]] += cost[i];
  double top = sums[0];
  for (int64_t q = 1; q < k; ++q)
    if (sums[q] > top) top = sums[q];
  return top;
}

}  // namespace

bool SmallStage(const std::vector<double>& cost, int64_t k, const std::vector<double>& fill_targets,
                const SmallStageOptions& o, std::vector<int64_t>* assign_ptr) {
  std::vector<int64_t>& best = *assign_ptr;
  double best_max = 0.0;
  for (std::size_t index = 0; index <= fill_targets.size(); ++index) {
    std::vector<int64_t> assign;
    if (index == 0) {
      assign = best;
    } else {
      assign = FillParts(cost, k, fill_targets[index - 1], o.fill_others, o.max_subsets);
      Descend(cost, k, o.rounds, o.bound, o.tol, o.small, /*equal_counts=*/false, o.bound_tolerance,
              o.partner_parts, &assign);
    }
    ResplitHeaviest(cost, k, o.resplit_rounds, o.bound, o.tol, /*equal_counts=*/false, o.bound_tolerance,
                    o.resplit_items, &assign);
    const double span = Span(cost, assign, k);
    if (span < best_max || index == 0) best.swap(assign), best_max = span;
    if (best_max <= o.target) return true;
  }
  return false;
}

}  // namespace jodc::balance
