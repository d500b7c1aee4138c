// See refine.h. Every comparison and sum mirrors jodc/balance/refine.py (_Refiner and refine_by_swaps, its
// plain-Python table scan); keep them in step.
// Fused multiply-adds cannot change a result here: the only products feeding an addition are by 2.0 (exact), and
// lower_bound * (1 + tolerance) is compared, not added to.
#include "balance/refine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

namespace jodc::balance {

double ExactSum(const std::vector<double>& values) {
  // Shewchuk's non-overlapping partials, then a correctly rounded (half-even) total: the algorithm math.fsum uses.
  std::vector<double> partials;
  for (double x : values) {
    size_t i = 0;
    for (size_t j = 0; j < partials.size(); ++j) {
      double y = partials[j];
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y;
      const double lo = y - (hi - x);
      if (lo != 0.0) partials[i++] = lo;
      x = hi;
    }
    partials.resize(i);
    partials.push_back(x);
  }
  size_t n = partials.size();
  double hi = 0.0;
  if (n > 0) {
    double lo = 0.0;
    hi = partials[--n];
    while (n > 0) {
      const double x = hi;
      const double y = partials[--n];
      hi = x + y;
      const double yr = hi - x;
      lo = y - yr;
      if (lo != 0.0) break;
    }
    // half-even rounding across the remaining partials: if the next one has lo's sign, hi may round the other way
    if (n > 0 && ((lo < 0.0 && partials[n - 1] < 0.0) || (lo > 0.0 && partials[n - 1] > 0.0))) {
      const double y = lo * 2.0;
      const double x = hi + y;
      const double yr = x - hi;
      if (y == yr) hi = x;
    }
  }
  return hi;
}

namespace {

struct Group {
  int64_t a, b;  // members, -1 where unused
  double cost, size;
  int64_t count;
};

int64_t GroupCount(int64_t n) { return 1 + n + n * (n - 1) / 2; }

struct Exchange {
  double gap;
  Group give, take;
};

class Refiner {
 public:
  Refiner(const std::vector<double>& cost, const std::vector<double>& size, bool has_capacity, double capacity,
          bool allow_moves, int64_t max_pair_table, std::vector<std::vector<int64_t>>* parts)
      : cost_(cost), size_(size), has_capacity_(has_capacity), capacity_(capacity), allow_moves_(allow_moves),
        max_pair_table_(max_pair_table), parts_(*parts) {
    for (auto& part : parts_) std::sort(part.begin(), part.end());
    tolerance_ = 1e-12 * std::max(ExactSum(cost_), 1e-300);
  }

  std::vector<double> Sums(const std::vector<double>& values) const {
    std::vector<double> out;
    out.reserve(parts_.size());
    std::vector<double> buffer;
    for (const auto& part : parts_) {
      buffer.clear();
      for (int64_t i : part) buffer.push_back(values[i]);
      out.push_back(ExactSum(buffer));
    }
    return out;
  }

  // _Refiner.py_groups: the empty group, the single items, then the pairs (i < j in part order).
  void Groups(int64_t p, int64_t max_items, std::vector<Group>* out) const {
    out->clear();
    const auto& items = parts_[p];
    const bool sized = has_capacity_;
    out->push_back({-1, -1, 0.0, 0.0, 0});
    for (int64_t i : items) out->push_back({i, -1, cost_[i], sized ? size_[i] : 0.0, 1});
    if (max_items >= 2)
      for (size_t a = 0; a < items.size(); ++a)
        for (size_t b = a + 1; b < items.size(); ++b) {
          const int64_t i = items[a], j = items[b];
          out->push_back({i, j, cost_[i] + cost_[j], sized ? size_[i] + size_[j] : 0.0, 2});
        }
  }

  // _Refiner._best_exchange (the plain-Python scan, which gives the numpy table's answer on every size).
  bool BestExchange(int64_t p, int64_t q, double gap, const std::vector<double>& totals, int64_t max_items,
                    Exchange* out) {
    const int64_t m_p = static_cast<int64_t>(parts_[p].size()), m_q = static_cast<int64_t>(parts_[q].size());
    if (max_items > 1 && GroupCount(m_p) * GroupCount(m_q) > max_pair_table_) return false;
    Groups(p, max_items, &give_);
    Groups(q, max_items, &take_);
    const double limit = gap - tolerance_;
    double total_p = 0.0, total_q = 0.0;
    if (has_capacity_) total_p = totals[p], total_q = totals[q];
    double best = std::numeric_limits<double>::infinity();
    const Group* found_g = nullptr;
    const Group* found_t = nullptr;
    for (const Group& g : give_) {
      const double g_cost = g.cost;
      for (const Group& t : take_) {
        const double delta = g_cost - t.cost;
        if (delta <= 0.0 || delta >= gap) continue;
        const double new_gap = std::fabs(gap - 2.0 * delta);
        if (!(new_gap < limit && new_gap < best)) continue;
        if (!allow_moves_ && g.count != t.count) continue;
        if (has_capacity_) {
          const double moved = g.size - t.size;
          if (!(total_p - moved <= capacity_ && total_q + moved <= capacity_)) continue;
        }
        best = new_gap;
        found_g = &g;
        found_t = &t;
      }
    }
    if (found_g == nullptr) return false;
    *out = {best, *found_g, *found_t};
    return true;
  }

  // _Refiner.next_exchange: (p, q, exchange) of the next improving exchange with groups of <= max_items.
  bool NextExchange(int64_t max_items, int64_t* p_out, int64_t* q_out, Exchange* ex_out) {
    const std::vector<double> sums = Sums(cost_);
    std::vector<double> totals;
    if (has_capacity_) totals = Sums(size_);
    const int64_t k = static_cast<int64_t>(parts_.size());
    std::vector<int64_t> order(k);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const double na = -sums[a], nb = -sums[b];
      if (na != nb) return na < nb;
      return a < b;
    });
    const int64_t heaviest = order[0];
    bool have_best = false;
    double best_max = 0.0;
    int64_t best_q = -1;
    Exchange best_ex{}, found{};
    for (int64_t idx = k - 1; idx >= 1; --idx) {
      const int64_t q = order[idx];
      const double gap = sums[heaviest] - sums[q];
      if (gap <= tolerance_) continue;
      if (BestExchange(heaviest, q, gap, totals, max_items, &found)) {
        const double new_max = (sums[heaviest] + sums[q] + found.gap) / 2.0;
        if (!have_best || new_max < best_max) {
          have_best = true;
          best_max = new_max;
          best_q = q;
          best_ex = found;
        }
      }
    }
    if (have_best) {
      *p_out = heaviest, *q_out = best_q, *ex_out = best_ex;
      return true;
    }
    std::vector<std::tuple<double, int64_t, int64_t>> pairs;  // (-(gap), p, q): Python's sort key
    for (int64_t a = 1; a < k; ++a)
      for (int64_t b = a + 1; b < k; ++b) {
        const int64_t p = order[a], q = order[b];
        pairs.emplace_back(-(sums[p] - sums[q]), p, q);
      }
    std::sort(pairs.begin(), pairs.end());
    for (const auto& [neg_gap, p, q] : pairs) {
      const double gap = sums[p] - sums[q];
      if (gap <= tolerance_) break;
      if (BestExchange(p, q, gap, totals, max_items, &found)) {
        *p_out = p, *q_out = q, *ex_out = found;
        return true;
      }
    }
    return false;
  }

  void Apply(int64_t p, int64_t q, const Exchange& ex) {
    auto move = [](std::vector<int64_t>& from, std::vector<int64_t>& to, const Group& out, const Group& in) {
      std::vector<int64_t> kept;
      for (int64_t i : from)
        if (i != out.a && i != out.b) kept.push_back(i);
      if (in.a >= 0) kept.push_back(in.a);
      if (in.b >= 0) kept.push_back(in.b);
      std::sort(kept.begin(), kept.end());
      from.swap(kept);
      (void)to;
    };
    move(parts_[p], parts_[q], ex.give, ex.take);
    move(parts_[q], parts_[p], ex.take, ex.give);
  }

  double MaxSum() const {
    double m = 0.0;  // numpy's max(initial=0.0)
    for (double s : Sums(cost_)) m = std::max(m, s);
    return m;
  }

 private:
  const std::vector<double>& cost_;
  const std::vector<double>& size_;
  bool has_capacity_;
  double capacity_;
  bool allow_moves_;
  int64_t max_pair_table_;
  std::vector<std::vector<int64_t>>& parts_;
  double tolerance_;
  std::vector<Group> give_, take_;
};

}  // namespace

void RefineBySwaps(const std::vector<double>& cost, const std::vector<double>& size, bool has_capacity,
                   double capacity, bool allow_moves, int64_t max_group, int64_t max_rounds, int64_t max_pair_table,
                   double lower_bound_tolerance, std::vector<std::vector<int64_t>>* parts) {
  Refiner refiner(cost, size, has_capacity, capacity, allow_moves, max_pair_table, parts);
  double largest = 0.0;
  for (double c : cost) largest = std::max(largest, c);
  const double k = static_cast<double>(std::max<size_t>(parts->size(), 1));
  const double lower_bound = std::max(largest, ExactSum(cost) / k);
  for (int64_t round = 0; round < max_rounds; ++round) {
    if (refiner.MaxSum() <= lower_bound * (1.0 + lower_bound_tolerance)) break;
    int64_t p = -1, q = -1;
    Exchange ex{};
    bool step = false;
    for (int64_t max_items = 1; max_items <= max_group && !step; ++max_items)
      step = refiner.NextExchange(max_items, &p, &q, &ex);
    if (!step) break;
    refiner.Apply(p, q, ex);
  }
}

}  // namespace jodc::balance
