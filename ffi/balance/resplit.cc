// See resplit.h. Mirrors jodc/balance/descent.py's resplit_heaviest and subset_sums operation for operation;
// keep them in step.
#include "balance/resplit.h"

#include "balance/parts.h"

#include <algorithm>
#include <cstddef>
#include <limits>

#include "balance/refine.h"

namespace jodc::balance {

void ResplitHeaviest(const std::vector<double>& cost, int64_t k, int64_t max_rounds, double bound, double tol,
                     bool equal_counts, double bound_tolerance, int64_t resplit_items, std::vector<int64_t>* assign_ptr) {
  std::vector<int64_t>& assign = *assign_ptr;
  const int64_t n = static_cast<int64_t>(cost.size());
  if (n == 0 || k < 2) return;
  std::vector<double> sums = PartSums(cost, assign, k);
  const double stop = StopThreshold(bound, bound_tolerance, tol);
  std::vector<int64_t> counts(k), mine, members;
  std::vector<double> side;
  for (int64_t round = 0; round < max_rounds; ++round) {
    const int64_t p = Heaviest(sums);
    const double top = sums[p];
    if (top <= stop) break;
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) counts[assign[i]] += 1;
    mine.clear();
    for (int64_t i = 0; i < n; ++i)
      if (assign[i] == p) mine.push_back(i);
    // The table's rows are the parts q != p (ascending) with few enough items together; each row's subsets beyond
    // its own items (the padding's bits) repeat earlier entries of the row exactly, so they are skipped: the first
    // smallest entry is the same.
    bool any = false, found = false;
    double best = std::numeric_limits<double>::infinity();
    int64_t best_q = -1, best_subset = 0;
    for (int64_t q = 0; q < k; ++q) {
      if (q == p || counts[p] + counts[q] > resplit_items) continue;
      any = true;
      members = mine;
      for (int64_t i = 0; i < n; ++i)
        if (assign[i] == q) members.push_back(i);
      const int64_t u = static_cast<int64_t>(members.size());
      side.assign(int64_t{1} << u, 0.0);
      for (int64_t j = 0; j < u; ++j) {  // subset_sums: s with highest bit j is (s without j) + cost j
        const int64_t width = int64_t{1} << j;
        const double c = cost[members[j]];
        for (int64_t s = 0; s < width; ++s) side[width + s] = side[s] + c;
      }
      const double pair = sums[p] + sums[q];
      for (int64_t s = 0; s < (int64_t{1} << u); ++s) {
        if (equal_counts) {
          const int64_t size = __builtin_popcountll(static_cast<unsigned long long>(s));
          if (size != counts[p] && size != counts[q]) continue;  // np.inf: never below top - tol
        }
        const double other = pair - side[s];
        const double heavier = side[s] >= other ? side[s] : other;  // np.maximum (no NaN)
        if (!found || heavier < best) {
          best = heavier, best_q = q, best_subset = s, found = true;
        }
      }
    }
    if (!any || !found || !(best < top - tol)) break;
    members = mine;  // the chosen row's items, as the table had them
    for (int64_t i = 0; i < n; ++i)
      if (assign[i] == best_q) members.push_back(i);
    std::vector<double> chosen, rest;
    for (std::size_t j = 0; j < members.size(); ++j) {
      const int64_t i = members[j];
      if (best_subset >> j & 1) {
        assign[i] = p, chosen.push_back(cost[i]);
      } else {
        assign[i] = best_q, rest.push_back(cost[i]);
      }
    }
    sums[p] = ExactSum(chosen);
    sums[best_q] = ExactSum(rest);
  }
}

}  // namespace jodc::balance
