// Next-token sampling with llama.cpp's controls: the arithmetic of spinquant_et/sampling.py, step for step
// (float64, SplitMix64 uniforms, ties ordered by token id), so both runners draw the same tokens for a seed
// wherever their logits agree. Chain, in llama.cpp's order: repetition penalty -> top-k -> top-p -> min-p ->
// temperature -> draw; temperature 0 is the argmax after the penalty.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <unordered_set>
#include <vector>

namespace spinquant {

struct SamplingConfig {
  double temperature = 0.0;  // 0: greedy
  int top_k = 0;             // 0: all
  double top_p = 0.9;        // 1: off
  double min_p = 0.0;        // 0: off
  double repeat_penalty = 1.0;  // 1: off
  int repeat_last_n = 64;
  uint64_t seed = 0;
};

// Steele et al.'s SplitMix64, as spinquant_et.sampling.SplitMix64.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1), 53 bits

 private:
  uint64_t state_;
};

// The next token for `logits[0..n)`; `history` is the context's token ids (for the repetition penalty).
inline size_t sample_token(const float* logits, size_t n, const SamplingConfig& c, SplitMix64& rng,
                           const std::vector<int64_t>& history) {
  const bool penalize = c.repeat_penalty != 1.0 && c.repeat_last_n > 0 && !history.empty();
  if (c.temperature <= 0 && !penalize) return std::max_element(logits, logits + n) - logits;
  std::vector<double> x(logits, logits + n);
  if (penalize) {
    size_t from = history.size() > static_cast<size_t>(c.repeat_last_n) ? history.size() - c.repeat_last_n : 0;
    std::unordered_set<int64_t> seen;
    for (size_t i = from; i < history.size(); ++i) {
      int64_t t = history[i];
      if (t < 0 || static_cast<size_t>(t) >= n || !seen.insert(t).second) continue;
      x[t] = x[t] > 0 ? x[t] / c.repeat_penalty : x[t] * c.repeat_penalty;
    }
  }
  if (c.temperature <= 0) return std::max_element(x.begin(), x.end()) - x.begin();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](size_t a, size_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  size_t keep = n;
  if (c.top_k > 0 && static_cast<size_t>(c.top_k) < n) {
    keep = c.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), before);
  } else {
    std::sort(order.begin(), order.end(), before);
  }
  const double top = x[order[0]];
  if (c.top_p < 1.0) {
    double total = 0;
    for (size_t i = 0; i < keep; ++i) total += std::exp(x[order[i]] - top);
    const double target = c.top_p * total;
    double acc = 0;
    for (size_t i = 0; i < keep; ++i) {
      acc += std::exp(x[order[i]] - top);
      if (acc >= target) {
        keep = i + 1;
        break;
      }
    }
  }
  if (c.min_p > 0.0) {
    const double floor = top + std::log(c.min_p);
    size_t k = 0;
    while (k < keep && x[order[k]] >= floor) ++k;
    keep = std::max<size_t>(k, 1);
  }
  std::vector<double> cum(keep);
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) cum[i] = acc += std::exp((x[order[i]] - top) / c.temperature);
  const double r = rng.uniform() * cum[keep - 1];
  size_t i = std::upper_bound(cum.begin(), cum.end(), r) - cum.begin();  // first cumulative mass above r
  return order[std::min(i, keep - 1)];
}

}  // namespace spinquant
