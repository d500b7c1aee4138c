// See fill.h. Mirrors jodc/balance/fill.py (fill_parts, _table, _row_sums) operation for operation; keep
// them in step.
#include "balance/fill.h"

#include <algorithm>
#include <cstddef>
#include <numeric>

namespace jodc::balance {
namespace {

// math.comb(m, r) for the small m here, saturating far above any MAX_SUBSETS.
int64_t Comb(int64_t m, int64_t r) {
  if (r < 0 || r > m) return 0;
  r = std::min(r, m - r);
  double c = 1.0;
  for (int64_t i = 1; i <= r; ++i) {
    c = c * static_cast<double>(m - r + i) / static_cast<double>(i);
    if (c > 4e18) return int64_t{4'000'000'000'000'000'000};
  }
  return static_cast<int64_t>(c + 0.5);
}

// fill.py's _table: the largest subset size up to max_others whose table holds at most max_subsets rows (at least 1).
int64_t TableSize(int64_t m, int64_t max_others, int64_t max_subsets) {
  int64_t size = std::min(max_others, m);
  while (size > 1) {
    int64_t rows = 0;
    for (int64_t r = 0; r <= size; ++r) rows = std::min(rows + Comb(m, r), int64_t{4'000'000'000'000'000'000});
    if (rows <= max_subsets) break;
    --size;
  }
  return size;
}

}  // namespace

std::vector<int64_t> FillParts(const std::vector<double>& cost, int64_t k, double target, int64_t max_others,
                               int64_t max_subsets) {
  const int64_t n = static_cast<int64_t>(cost.size());
  std::vector<int64_t> remaining(n);
  std::iota(remaining.begin(), remaining.end(), 0);
  std::stable_sort(remaining.begin(), remaining.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<int64_t> assign(n, k - 1), others, combo, best;
  for (int64_t part = 0; part < k - 1; ++part) {
    if (remaining.empty()) break;
    const int64_t first = remaining[0];
    assign[first] = part;
    const double room = target - cost[first];
    others.clear();
    for (std::size_t t = 1; t < remaining.size(); ++t)
      if (cost[remaining[t]] <= room) others.push_back(remaining[t]);
    const int64_t m = static_cast<int64_t>(others.size());
    if (m) {
      const int64_t size = TableSize(m, max_others, max_subsets);
      // np.argmax(where(sums <= room, sums, -1.0)): the first largest; the empty subset (sum 0.0) is row 0
      double best_value = 0.0 <= room ? 0.0 : -1.0;
      best.clear();
      for (int64_t r = 1; r <= size; ++r) {
        combo.resize(r);
        std::iota(combo.begin(), combo.end(), 0);
        while (true) {
          double sum = 0.0;  // _row_sums: left to right (the padding adds 0.0)
          for (int64_t c : combo) sum += cost[others[c]];
          const double value = sum <= room ? sum : -1.0;
          if (value > best_value) best_value = value, best = combo;
          int64_t i = r - 1;  // the next combination in itertools.combinations' order
          while (i >= 0 && combo[i] == m - r + i) --i;
          if (i < 0) break;
          ++combo[i];
          for (int64_t j = i + 1; j < r; ++j) combo[j] = combo[j - 1] + 1;
        }
      }
      for (int64_t c : best) assign[others[c]] = part;
    }
    std::vector<int64_t> left;
    for (std::size_t t = 1; t < remaining.size(); ++t)
      if (assign[remaining[t]] == k - 1) left.push_back(remaining[t]);
    remaining.swap(left);
  }
  return assign;
}

}  // namespace jodc::balance
