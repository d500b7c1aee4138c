// See search.h. Every comparison and sum mirrors jodc/balance/search.py line for line; keep them in step.
#include "balance/search.h"

#include <algorithm>
#include <numeric>

namespace jodc::balance {
namespace {

// Parts ordered by load, ties by part number (Python's stable sorted(range(k), key=loads.__getitem__)).
void SortByLoad(const std::vector<double>& loads, std::vector<int64_t>* order) {
  std::iota(order->begin(), order->end(), 0);
  std::stable_sort(order->begin(), order->end(), [&](int64_t a, int64_t b) { return loads[a] < loads[b]; });
}

// The room below the incumbent, summed left to right over the parts (as search.py does).
double Room(const std::vector<double>& loads, double limit) {
  double room = 0.0;
  for (double load : loads)
    if (load < limit) room += limit - load;
  return room;
}

struct State {
  const std::vector<double>& cost;
  const std::vector<double>& size;
  const std::vector<double>& remaining_after;
  int64_t k, n;
  double tolerance;
  bool free_search, equal_sizes;
  int64_t count_cap, count_floor;
  double cap;
  std::vector<double> loads, totals;
  std::vector<int64_t> counts, order;
  double best;

  // _search_free's candidates(depth).
  void FreeCandidates(int64_t depth, std::vector<int64_t>* chosen) {
    chosen->clear();
    const double limit = best - tolerance;
    if (Room(loads, limit) < remaining_after[depth] - tolerance) return;
    const double c = cost[depth];
    SortByLoad(loads, &order);
    bool have_last = false;
    double last = 0.0;
    std::vector<int64_t> run;
    for (int64_t p : order) {
      const double load = loads[p];
      if (load + c >= limit) break;
      if (have_last && load == last) {
        if (std::find(run.begin(), run.end(), counts[p]) != run.end()) continue;
        run.push_back(counts[p]);
      } else {
        have_last = true;
        last = load;
        run.assign(1, counts[p]);
      }
      chosen->push_back(p);
    }
  }

  // _search_general's candidates(depth).
  void GeneralCandidates(int64_t depth, std::vector<int64_t>* chosen) {
    chosen->clear();
    const double limit = best - tolerance;
    if (Room(loads, limit) < remaining_after[depth] - tolerance) return;
    if (equal_sizes) {
      int64_t missing = 0;
      for (int64_t c : counts) missing += std::max<int64_t>(0, count_floor - c);
      if (missing > n - depth) return;
    }
    const double c = cost[depth], z = size[depth];
    SortByLoad(loads, &order);
    for (int64_t p : order) {
      const double load = loads[p];
      if (load + c >= limit || counts[p] >= count_cap || totals[p] + z > cap) continue;
      bool seen = false;
      for (int64_t q : *chosen)  // the states of the parts chosen so far are unchanged: compare with them
        if (loads[q] == load && counts[q] == counts[p] && totals[q] == totals[p]) {
          seen = true;
          break;
        }
      if (!seen) chosen->push_back(p);
    }
  }

  void Candidates(int64_t depth, std::vector<int64_t>* chosen) {
    if (free_search)
      FreeCandidates(depth, chosen);
    else
      GeneralCandidates(depth, chosen);
  }
};

}  // namespace

bool SearchPartition(const std::vector<double>& ordered_cost, const std::vector<double>& ordered_size,
                     const std::vector<double>& remaining_after, int64_t k, double best_max, double tolerance,
                     double lower_bound, int64_t node_budget, bool free_search, bool equal_sizes, int64_t count_cap,
                     int64_t count_floor, double cap, std::vector<int64_t>* assignment) {
  const int64_t n = static_cast<int64_t>(ordered_cost.size());
  if (n == 0 || k <= 0) return false;
  State s{ordered_cost, ordered_size, remaining_after, k, n, tolerance, free_search, equal_sizes, count_cap,
          count_floor, cap};
  s.loads.assign(k, 0.0);
  s.totals.assign(k, 0.0);
  s.counts.assign(k, 0);
  s.order.assign(k, 0);
  s.best = best_max;
  std::vector<std::vector<int64_t>> frames(n);
  std::vector<size_t> position(n, 0);
  std::vector<int64_t> placed(n, -1), current(n, 0);
  std::vector<double> before_load(n, 0.0), before_total(n, 0.0);
  bool found = false;
  int64_t nodes = 0;

  int64_t depth = 0;
  s.Candidates(0, &frames[0]);
  while (depth >= 0) {
    int64_t p = placed[depth];
    if (p >= 0) {  // undo this depth's previous choice, restoring the exact previous sums
      s.loads[p] = before_load[depth];
      s.totals[p] = before_total[depth];
      s.counts[p] -= 1;
      placed[depth] = -1;
    }
    const std::vector<int64_t>& frame = frames[depth];
    const size_t i = position[depth];
    if (i >= frame.size()) {
      depth -= 1;
      continue;
    }
    p = frame[i];
    position[depth] = i + 1;
    const double c = ordered_cost[depth];
    if (s.loads[p] + c >= s.best - tolerance) continue;  // the incumbent improved since the list was made
    nodes += 1;
    if (nodes > node_budget) break;
    placed[depth] = p;
    before_load[depth] = s.loads[p];
    before_total[depth] = s.totals[p];
    s.loads[p] += c;
    s.counts[p] += 1;
    if (!free_search) s.totals[p] += ordered_size[depth];
    current[depth] = p;
    if (depth + 1 == n) {
      if (free_search || !equal_sizes || *std::min_element(s.counts.begin(), s.counts.end()) >= count_floor) {
        s.best = *std::max_element(s.loads.begin(), s.loads.end());
        *assignment = current;
        found = true;
        if (s.best <= lower_bound + tolerance) break;
      }
      continue;
    }
    depth += 1;
    s.Candidates(depth, &frames[depth]);
    position[depth] = 0;
  }
  return found;
}

}  // namespace jodc::balance
