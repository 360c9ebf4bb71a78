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

// XNNPACK's AVX kernels can return with the upper halves of the vector registers dirty; the SSE-encoded
// scalar code here (and libm's exp) then pays a penalty on every instruction on Intel cores: measured
// 75 ns per exp() right after a forward call against 8 ns alone, 7.5 ms of a 14 ms decode step. One
// vzeroupper clears that state (where the CPU has AVX; a no-op elsewhere).
inline void clear_upper_vector_state() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool has_avx = __builtin_cpu_supports("avx");
  if (has_avx) asm volatile("vzeroupper" ::: "memory");
#endif
}

// The next token for `logits[0..n)`; `history` is the context's token ids (for the repetition penalty).
inline size_t sample_token(const float* logits, size_t n, const SamplingConfig& c, SplitMix64& rng,
                           const std::vector<int64_t>& history) {
  clear_upper_vector_state();
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
  // Candidates stay in token-id order until a control ranks them (top-k, top-p); ranked ones come from
  // partial sorts (a full sort of a 49152-token vocabulary per step took a third of the decode time).
  const double top = *std::max_element(x.begin(), x.end());
  auto before = [&](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::vector<int64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  // the ids of the m largest logits, ranked (what a full sort would put first)
  auto ranked_prefix = [&](size_t m) {
    std::vector<int64_t> order(all);
    std::partial_sort(order.begin(), order.begin() + m, order.end(), before);
    order.resize(m);
    return order;
  };
  const bool ranked = c.top_k > 0 && static_cast<size_t>(c.top_k) < n;
  std::vector<int64_t> cand = ranked ? ranked_prefix(c.top_k) : all;
  if (c.top_p < 1.0) {
    double total = 0;
    for (int64_t id : cand) total += std::exp(x[id] - top);  // the candidates' mass, in their order
    const double target = c.top_p * total;
    size_t m = std::min<size_t>(64, cand.size());
    while (true) {  // the shortest ranked prefix whose mass reaches top_p of it
      std::vector<int64_t> prefix = ranked ? std::vector<int64_t>(cand.begin(), cand.begin() + m) : ranked_prefix(m);
      double acc = 0;
      size_t keep = m + 1;
      for (size_t i = 0; i < m; ++i) {
        acc += std::exp(x[prefix[i]] - top);
        if (acc >= target) {
          keep = i + 1;
          break;
        }
      }
      if (keep <= m || m == cand.size()) {
        prefix.resize(std::min(keep, m));
        cand = std::move(prefix);
        break;
      }
      m = std::min(4 * m, cand.size());
    }
  }
  if (c.min_p > 0.0) {  // in their order; the top token always stays
    const double floor = top + std::log(c.min_p);
    std::vector<int64_t> kept;
    for (int64_t id : cand)
      if (x[id] >= floor) kept.push_back(id);
    cand = std::move(kept);
  }
  std::vector<double> cum(cand.size());
  double acc = 0;
  for (size_t i = 0; i < cand.size(); ++i) cum[i] = acc += std::exp((x[cand[i]] - top) / c.temperature);
  const double r = rng.uniform() * cum.back();
  size_t i = std::upper_bound(cum.begin(), cum.end(), r) - cum.begin();  // first cumulative mass above r
  return static_cast<size_t>(cand[std::min(i, cand.size() - 1)]);
}

}  // namespace spinquant
