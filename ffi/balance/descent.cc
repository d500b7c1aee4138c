// See descent.h. Every table entry mirrors jodc/balance/descent.py (descend, _small_exchanges, _moves)
// operation for operation; keep them in step.
#include "balance/descent.h"

#include "balance/parts.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

namespace jodc::balance {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// numpy's np.maximum for the values here (no NaN).
inline double Max(double a, double b) { return a >= b ? a : b; }

// A candidate: the new heaviest of the touched parts, its kind (descent.py's numbering) and its items / part.
struct Option {
  double value;
  int kind;
  int64_t a, b, c, d;
};

// Keeps the first smallest entry, as np.argmin over a row-major table does.
struct Best {
  double value = kInf;
  int64_t row = 0, col = 0;
  bool any = false;
  void Offer(double v, int64_t r, int64_t c) {
    if (!any) {
      value = v, row = r, col = c, any = true;
      return;
    }
    if (v < value) value = v, row = r, col = c;
  }
};

}  // namespace

void Descend(const std::vector<double>& cost, int64_t k, int64_t max_rounds, double bound, double tol, bool small,
             bool equal_counts, double bound_tolerance, int64_t partner_parts, std::vector<int64_t>* assign_ptr) {
  std::vector<int64_t>& assign = *assign_ptr;
  const int64_t n = static_cast<int64_t>(cost.size());
  if (n == 0 || k < 2) return;
  std::vector<double> sums = PartSums(cost, assign, k);
  std::vector<int64_t> counts(k, 0);
  for (int64_t i = 0; i < n; ++i) counts[assign[i]] += 1;
  std::vector<int64_t> mine, rest, light, order(k);
  std::vector<double> cp, cr, sq;
  std::vector<int64_t> qr, gap;
  std::vector<char> partner(k);
  std::vector<Option> options;
  std::vector<std::pair<int64_t, int64_t>> mine_pairs;
  const double stop = StopThreshold(bound, bound_tolerance, tol);
  for (int64_t round = 0; round < max_rounds; ++round) {
    const int64_t p = Heaviest(sums);
    const double top = sums[p];
    if (top <= stop) break;
    const double limit = top - tol;
    mine.clear();
    cp.clear();
    for (int64_t i = 0; i < n; ++i)
      if (assign[i] == p) mine.push_back(i), cp.push_back(cost[i]);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sums[a] < sums[b]; });
    light.clear();
    for (int64_t q : order)
      if (q != p) light.push_back(q);
    rest.clear();
    if (k - 1 > partner_parts) {
      std::fill(partner.begin(), partner.end(), 0);
      for (int64_t t = 0; t < partner_parts; ++t) partner[light[t]] = 1;
      for (int64_t i = 0; i < n; ++i)
        if (partner[assign[i]]) rest.push_back(i);
    } else {
      for (int64_t i = 0; i < n; ++i)
        if (assign[i] != p) rest.push_back(i);
    }
    const int64_t nr = static_cast<int64_t>(rest.size()), m = static_cast<int64_t>(mine.size());
    cr.resize(nr), qr.resize(nr), sq.resize(nr), gap.resize(nr);
    for (int64_t j = 0; j < nr; ++j) {
      cr[j] = cost[rest[j]], qr[j] = assign[rest[j]], sq[j] = sums[qr[j]];
      gap[j] = counts[qr[j]] - counts[p];
    }
    if (equal_counts) {
      std::vector<int64_t> kept;
      for (int64_t q : light)
        if (counts[q] == counts[p] - 1) kept.push_back(q);
      light.swap(kept);
    }
    const int64_t l1 = light.empty() ? -1 : light[0];
    const int64_t l2 = light.size() > 1 ? light[1] : l1;
    options.clear();
    if (l1 >= 0) {  // move
      Best best;
      for (int64_t i = 0; i < m; ++i) best.Offer(Max(top - cp[i], sums[l1] + cp[i]), i, 0);
      options.push_back({best.value, 0, mine[best.row], l1, -1, -1});
    }
    if (nr) {
      Best best;  // swap
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < nr; ++j) {
          const double d = cp[i] - cr[j];
          best.Offer(d > 0 ? Max(top - d, sq[j] + d) : kInf, i, j);
        }
      options.push_back({best.value, 1, mine[best.row], rest[best.col], -1, -1});
      if (k >= 3 && l1 >= 0) {  // ejection chain
        Best chain;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < nr; ++j) {
            const int64_t r = qr[j] == l1 ? l2 : l1;
            const double third = (r == qr[j] ? kInf : sums[r]) + cr[j];
            chain.Offer(Max(Max(top - cp[i], sq[j] + cp[i] - cr[j]), third), i, j);
          }
        const int64_t j = chain.col;
        options.push_back({chain.value, 2, mine[chain.row], rest[j], qr[j] == l1 ? l2 : l1, -1});
      }
    }
    if (small && nr) {
      // pairs of p's items in np.triu_indices order: the 2-for-1 and the 2-for-2 exchanges' rows
      mine_pairs.clear();
      for (int64_t a = 0; a < m; ++a)
        for (int64_t b = a + 1; b < m; ++b) mine_pairs.emplace_back(a, b);
      if (m >= 2) {  // 2-for-1
        Best best;
        int64_t g = 0;
        for (const auto& [a, b] : mine_pairs) {
          const double pair = cp[a] + cp[b];
          for (int64_t j = 0; j < nr; ++j) {
            const double d = pair - cr[j];
            const bool ok = d > 0 && (!equal_counts || gap[j] == -1);
            best.Offer(ok ? Max(top - d, sq[j] + d) : kInf, g, j);
          }
          ++g;
        }
        const auto& [a, b] = mine_pairs[best.row];
        options.push_back({best.value, 3, mine[a], mine[b], rest[best.col], -1});
      }
      if (nr >= 2) {
        std::vector<std::pair<int64_t, int64_t>> same;  // pairs of rest items in one part, triu order
        for (int64_t a = 0; a < nr; ++a)
          for (int64_t b = a + 1; b < nr; ++b)
            if (qr[a] == qr[b]) same.emplace_back(a, b);
        const int64_t ns = static_cast<int64_t>(same.size());
        if (ns) {
          std::vector<double> pair(ns);
          for (int64_t g = 0; g < ns; ++g) pair[g] = cr[same[g].first] + cr[same[g].second];
          Best best;  // 1-for-2
          for (int64_t i = 0; i < m; ++i)
            for (int64_t g = 0; g < ns; ++g) {
              const double d = cp[i] - pair[g];
              const bool ok = d > 0 && (!equal_counts || gap[same[g].first] == 1);
              best.Offer(ok ? Max(top - d, sq[same[g].first] + d) : kInf, i, g);
            }
          options.push_back({best.value, 4, mine[best.row], rest[same[best.col].first],
                             rest[same[best.col].second], -1});
          if (equal_counts && m >= 2) {  // 2-for-2
            Best both;
            int64_t h = 0;
            for (const auto& [a, b] : mine_pairs) {
              const double give = cp[a] + cp[b];
              for (int64_t g = 0; g < ns; ++g) {
                const double d = give - pair[g];
                both.Offer(d > 0 ? Max(top - d, sq[same[g].first] + d) : kInf, h, g);
              }
              ++h;
            }
            const auto& [a, b] = mine_pairs[both.row];
            options.push_back({both.value, 6, mine[a], mine[b], rest[same[both.col].first],
                               rest[same[both.col].second]});
          }
        }
        // 3-cycle: i p -> q, j q -> r, l r -> p (q != r), (j, l) in np.nonzero's row-major order
        std::vector<std::pair<int64_t, int64_t>> cols;
        for (int64_t j = 0; j < nr; ++j)
          for (int64_t l = 0; l < nr; ++l)
            if (qr[j] != qr[l]) cols.emplace_back(j, l);
        const int64_t nc = static_cast<int64_t>(cols.size());
        if (nc) {
          Best cycle;
          for (int64_t i = 0; i < m; ++i)
            for (int64_t g = 0; g < nc; ++g) {
              const auto [j, l] = cols[g];
              const double new_q = sq[j] + cp[i] - cr[j];
              const double new_r = sq[l] + cr[j] - cr[l];
              const double new_p = top - cp[i] + cr[l];
              cycle.Offer(Max(Max(new_p, new_q), new_r), i, g);
            }
          const auto [j, l] = cols[cycle.col];
          options.push_back({cycle.value, 5, mine[cycle.row], rest[j], rest[l], -1});
        }
      }
    }
    if (options.empty()) break;
    const Option* chosen = &options[0];  // min by (value, kind): the first such
    for (const Option& o : options)
      if (o.value < chosen->value || (o.value == chosen->value && o.kind < chosen->kind)) chosen = &o;
    if (!(chosen->value < limit)) break;
    // _moves: (item, new part) pairs, parts read before any item moves
    std::vector<std::pair<int64_t, int64_t>> moves;
    const Option& o = *chosen;
    switch (o.kind) {
      case 0: moves = {{o.a, o.b}}; break;
      case 1: moves = {{o.a, assign[o.b]}, {o.b, p}}; break;
      case 2: moves = {{o.a, assign[o.b]}, {o.b, o.c}}; break;
      case 3: moves = {{o.a, assign[o.c]}, {o.b, assign[o.c]}, {o.c, p}}; break;
      case 4: moves = {{o.a, assign[o.b]}, {o.b, p}, {o.c, p}}; break;
      case 6: moves = {{o.a, assign[o.c]}, {o.b, assign[o.c]}, {o.c, p}, {o.d, p}}; break;
      default: moves = {{o.a, assign[o.b]}, {o.b, assign[o.c]}, {o.c, p}}; break;  // 5: 3-cycle
    }
    for (const auto& [item, target] : moves) {  // fixed order: the same sums on every host
      sums[assign[item]] -= cost[item];
      sums[target] += cost[item];
      counts[assign[item]] -= 1;
      counts[target] += 1;
    }
    for (const auto& [item, target] : moves) assign[item] = target;
  }
}

}  // namespace jodc::balance
