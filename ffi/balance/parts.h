// Per-part cost sums and the "good enough" threshold shared by the compiled LB-Mini refinement steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace jodc::balance {

// Each part's summed cost, added in item order as np.bincount(weights=) does (the plan must equal the Python one).
inline std::vector<double> PartSums(const std::vector<double>& cost, const std::vector<int64_t>& assign, int64_t k) {
  std::vector<double> sums(k, 0.0);
  for (std::size_t i = 0; i < cost.size(); ++i) sums[assign[i]] += cost[i];
  return sums;
}

// The heaviest part: the first largest sum, as np.argmax picks it.
inline int64_t Heaviest(const std::vector<double>& sums) {
  int64_t p = 0;
  for (int64_t q = 1; q < static_cast<int64_t>(sums.size()); ++q)
    if (sums[q] > sums[p]) p = q;
  return p;
}

// bound * (1 + bound_tolerance) + tol with the product rounded before the addition, as Python does: volatile keeps a
// compiler from contracting the two into one fused multiply-add (GCC does where the target has one, e.g. aarch64).
inline double StopThreshold(double bound, double bound_tolerance, double tol) {
  volatile double scaled = bound * (1.0 + bound_tolerance);
  return scaled + tol;
}

}  // namespace jodc::balance
