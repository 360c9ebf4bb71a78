// spinquant-run: generate text with a spinquant-et .pte, with no Python and no libtorch.
//
//   spinquant-run --model model.pte [--tokenizer tokenizer.json] --prompt "..." [--chat]
//                 [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--threads K]
//                 [--ids] [--ignore-eos] [--warmup] [--no-weight-cache] [--verbose]
//   spinquant-run --tokenizer tokenizer.json --encode FILE     (prints the token ids of FILE)
//
// Prefill runs the whole prompt in one forward call, then one token per call; the KV cache lives
// in the program's mutable buffers. Text streams to stdout; time to first token, prefill and
// decode tokens/s and peak RSS go to stderr. Errors are one line on stderr and exit code 2.
// ExecuTorch's own log lines (cpuinfo probes, "Missing operator") are kept back unless --verbose;
// an error that they explain quotes them.

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/platform/platform.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tokenizer.h"

// Declared here because the wheel ships the library but not threadpool.h (same signatures).
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace {

using executorch::extension::from_blob;
using executorch::extension::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using Clock = std::chrono::steady_clock;

struct Fail : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ExecuTorch logs through its platform layer (PAL); ours prints with --verbose and otherwise keeps
// the lines, so a user sees one error line, not the runtime's Info/Error chatter before it.
bool g_verbose = false;
std::vector<std::string> g_runtime_log;

void emit_runtime_log(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
                      const char* message, size_t length) {
  std::string text(message, length);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  if (g_verbose) fprintf(stderr, "%c [%s:%zu] %s\n", static_cast<char>(level), filename, line, text.c_str());
  if (g_runtime_log.size() < 10000) g_runtime_log.push_back(text);  // loading logs; decode does not
}

// "a, b" of the operators the runtime reported missing while loading.
std::string missing_operators() {
  const std::string key = "Missing operator: ";
  std::set<std::string> names;
  for (const auto& line : g_runtime_log) {
    auto at = line.find(key);
    if (at == std::string::npos) continue;
    std::string rest = line.substr(at + key.size());
    if (auto close = rest.find("] "); close != std::string::npos) rest = rest.substr(close + 2);
    names.insert(rest);
  }
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "run with --verbose to see them" : out;
}

struct Args {
  std::string model, tokenizer, prompt, encode;
  bool chat = false, ids = false, ignore_eos = false, warmup = false, weight_cache = true;
  int max_new_tokens = 128, threads = 2;
  double temperature = 0.0, top_p = 0.9;
  uint64_t seed = 0;
};

const char* kUsage =
    "usage: spinquant-run --model model.pte [--tokenizer tokenizer.json] --prompt TEXT [--chat]\n"
    "                     [--max-new-tokens 128] [--temperature 0] [--top-p 0.9] [--seed 0] [--threads 2]\n"
    "                     [--ids] [--ignore-eos] [--warmup] [--no-weight-cache] [--verbose]\n"
    "       spinquant-run --tokenizer tokenizer.json --encode FILE\n"
    "--tokenizer defaults to tokenizer.json beside the .pte; --chat wraps the prompt in the chat\n"
    "template that `spinquant-et export` renders to chat.json beside it; --ids prints token ids\n"
    "instead of text; temperature 0 is greedy; --warmup runs the prompt and one decode step once\n"
    "before the timed run (the first calls of a program allocate and plan; benchmarks time warm calls);\n"
    "--no-weight-cache packs the weights once per method instead of sharing one packed copy (about\n"
    "twice the memory of a three-method program, ~6% faster decode measured on one machine);\n"
    "--verbose shows ExecuTorch's own log lines.\n"
    "Where transparent huge pages are `madvise`, the runner restarts itself with\n"
    "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (malloc on huge pages: ~10% faster decode measured);\n"
    "set GLIBC_TUNABLES=glibc.malloc.hugetlb=0 to keep 4 KiB pages.\n";

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Fail(k + " needs a value");
      return argv[++i];
    };
    try {
      if (k == "--model") a.model = value();
      else if (k == "--tokenizer") a.tokenizer = value();
      else if (k == "--prompt") a.prompt = value();
      else if (k == "--encode") a.encode = value();
      else if (k == "--chat") a.chat = true;
      else if (k == "--ids") a.ids = true;
      else if (k == "--ignore-eos") a.ignore_eos = true;
      else if (k == "--warmup") a.warmup = true;
      else if (k == "--no-weight-cache") a.weight_cache = false;
      else if (k == "--verbose" || k == "-v") g_verbose = true;  // read by the log handler
      else if (k == "--max-new-tokens") a.max_new_tokens = std::stoi(value());
      else if (k == "--threads") a.threads = std::stoi(value());
      else if (k == "--temperature") a.temperature = std::stod(value());
      else if (k == "--top-p") a.top_p = std::stod(value());
      else if (k == "--seed") a.seed = std::stoull(value());
      else if (k == "--help" || k == "-h") {
        std::cout << kUsage;
        std::exit(0);
      } else {
        throw Fail("unknown option " + k + " (see --help)");
      }
    } catch (const std::invalid_argument&) {
      throw Fail(k + " needs a number");
    }
  }
  if (a.encode.empty() && a.model.empty()) throw Fail("--model is required (see --help)");
  if (a.tokenizer.empty() && !a.model.empty()) {
    auto slash = a.model.find_last_of('/');
    a.tokenizer = (slash == std::string::npos ? std::string() : a.model.substr(0, slash + 1)) + "tokenizer.json";
  }
  return a;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Fail("cannot open " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<int64_t> metadata_ints(Module& m, const std::string& name) {
  std::vector<int64_t> out;
  auto names = m.method_names();
  if (!names.ok() || !names->count(name)) return out;
  auto r = m.execute(name);
  if (!r.ok()) return out;
  for (const auto& v : *r) {
    if (v.isInt()) out.push_back(v.toInt());
    else if (v.isBool()) out.push_back(v.toBool());
  }
  return out;
}

size_t sample(const float* logits, size_t n, double temperature, double top_p, std::mt19937_64& rng) {
  if (temperature <= 0) return std::max_element(logits, logits + n) - logits;
  std::vector<double> p(n);
  double mx = *std::max_element(logits, logits + n), sum = 0;
  for (size_t i = 0; i < n; ++i) sum += p[i] = std::exp((logits[i] - mx) / temperature);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  double kept = 0;
  size_t k = 0;
  while (k < n && (k == 0 || kept < top_p * sum)) kept += p[order[k++]];
  std::uniform_real_distribution<double> u(0, kept);
  double r = u(rng);
  for (size_t i = 0; i < k; ++i) {
    r -= p[order[i]];
    if (r <= 0) return order[i];
  }
  return order[k - 1];
}

// Peak resident memory of this program. VmHWM, not getrusage: ru_maxrss survives exec, so a runner
// started by a large process (a Python benchmark) would report its parent's peak.
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss / 1024.0;
}

int run(const Args& a) {
  spinquant::Tokenizer tok = [&]() {
    try {
      return spinquant::Tokenizer(a.tokenizer);
    } catch (const std::runtime_error& e) {
      throw Fail(std::string("tokenizer: ") + e.what());
    }
  }();
  if (!a.encode.empty()) {
    for (int64_t id : tok.encode(read_file(a.encode))) std::cout << id << '\n';
    return 0;
  }
  if (g_verbose) {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    std::cerr << "spinquant-run: GLIBC_TUNABLES=" << (tunables ? tunables : "") << "\n";
  }
  if (a.threads > 0) executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(a.threads);

  std::ifstream probe(a.model);
  if (!probe) throw Fail(".pte not found: " + a.model);
  // XNNPACK packs each delegate's weights when its method loads. forward, forward_ctx and forward_near
  // read the same weights, so without its weight cache they are packed once per method (Llama-3.1-8B
  // shape: 15.1 GiB RSS for a 4.6 GiB file, 6.5 GiB with the cache; Llama-3.2-1B shape: 3.4 against
  // 1.8 GiB). --no-weight-cache trades that memory for ~6% faster decode (1B shape, this VM).
  if (a.weight_cache) {
    executorch::runtime::BackendOptions<1> xnnpack;
    xnnpack.set_option("weight_cache_enabled", true);
    if (executorch::runtime::set_option("XnnpackBackend", xnnpack.view()) != Error::Ok)
      std::cerr << "spinquant-run: XNNPACK took no weight-cache option; each method packs its own weights\n";
  }
  // share_memory_arenas: forward, forward_ctx and forward_near read and write one KV cache (one allocation)
  Module module(a.model, Module::LoadMode::MmapUseMlockIgnoreErrors, nullptr, nullptr, nullptr,
                /*share_memory_arenas=*/true);
  if (module.load() != Error::Ok) throw Fail(a.model + " is not an ExecuTorch program (corrupt or not a .pte); re-export it");
  Error err = module.load_method("forward");
  if (err == Error::OperatorMissing)
    throw Fail(a.model + ": this runtime lacks operators the program needs (" + missing_operators() +
               "); re-export with --ops portable");
  if (err != Error::Ok) throw Fail(a.model + ": cannot load its forward method (error " + std::to_string(int(err)) + ")");
  // forward_ctx(tokens, start_pos, ctx): forward whose attention reads only the cache's first len(ctx)
  // positions (the filled context); ctx's values are never read, only its length.
  // forward_near(token, start_pos): one decode step whose attention reads, in place, a copy of the cache's
  // first get_near_len positions that every method writes (right while the filled context fits in it).
  auto load_optional = [&](const char* name) {
    auto names = module.method_names();
    if (!names.ok() || !names->count(name)) return false;
    if (module.load_method(name) != Error::Ok) throw Fail(a.model + ": cannot load its " + name + " method");
    return true;
  };
  // spill_near(): forward_near writes only its copy; this writes it into the cache, once, before another
  // method follows forward_near steps (a program without it has a forward_near that writes both).
  const bool has_ctx = load_optional("forward_ctx"), has_near = load_optional("forward_near"),
             has_spill = load_optional("spill_near");
  bool near_unspilled = false;
  auto max_len = metadata_ints(module, "get_max_seq_len");
  const int64_t max_seq_len = max_len.empty() ? 128 : max_len[0];
  auto near_lens = metadata_ints(module, "get_near_len");
  const int64_t near_len = near_lens.empty() ? 0 : near_lens[0];
  std::vector<float> ctx_values(max_seq_len, 0.0f);
  auto eos_list = metadata_ints(module, "get_eos_ids");
  std::set<int64_t> eos(eos_list.begin(), eos_list.end());

  std::string prompt = a.prompt;
  if (a.chat) {
    auto slash = a.tokenizer.find_last_of('/');
    std::string chat = (slash == std::string::npos ? std::string() : a.tokenizer.substr(0, slash + 1)) + "chat.json";
    std::ifstream f(chat);
    if (!f) throw Fail("no chat template (" + chat + "); drop --chat or re-export the model");
    auto j = nlohmann::json::parse(f);
    prompt = j.at("prefix").get<std::string>() + a.prompt + j.at("suffix").get<std::string>();
  }
  std::vector<int64_t> ids = tok.encode(prompt);
  if (ids.empty()) throw Fail("the prompt is empty");
  if (static_cast<int64_t>(ids.size()) > max_seq_len - 1)
    throw Fail("the prompt has " + std::to_string(ids.size()) + " tokens but the program's context is " +
               std::to_string(max_seq_len) + "; shorten it or re-export with a larger --max-seq-len");

  // One forward call of `input` at position `start`, through the method spinquant_et.runtime.choose_method
  // picks: a decode step through forward_near while the context fits its cache; else forward_ctx, which
  // copies the filled K/V out of the cache, so a decode step past half the cache (and the very last
  // position) runs through forward.
  auto step = [&](std::vector<int64_t>& input, int64_t start) {
    auto tokens = from_blob(input.data(), {1, static_cast<int>(input.size())}, executorch::aten::ScalarType::Long);
    auto start_pos = from_blob(&start, {1}, executorch::aten::ScalarType::Long);
    std::string method = "forward";
    std::vector<EValue> inputs{EValue(*tokens), EValue(*start_pos)};
    const int64_t filled = start + static_cast<int64_t>(input.size());
    auto ctx = from_blob(ctx_values.data(), {static_cast<int>(filled)}, executorch::aten::ScalarType::Float);
    if (has_near && input.size() == 1 && filled <= near_len) {
      method = "forward_near";
    } else if (has_ctx && filled < max_seq_len && (input.size() > 1 || 2 * filled <= max_seq_len)) {
      method = "forward_ctx";
      inputs.emplace_back(*ctx);
    }
    if (method == "forward_near") {
      near_unspilled = has_spill;
    } else if (near_unspilled) {
      if (!module.execute("spill_near").ok()) throw Fail("spill_near failed at position " + std::to_string(start));
      if (g_verbose) std::cerr << "spinquant-run: spill_near before " << method << " at position " << start << "\n";
      near_unspilled = false;
    }
    auto result = module.execute(method, inputs);
    if (!result.ok()) throw Fail(method + " failed at position " + std::to_string(start) + " (error " +
                                 std::to_string(int(result.error())) + ")");
    return std::move(*result);
  };
  if (a.warmup) {  // the prompt fits with a position to spare (checked above)
    // the timed run writes every position it reads again before reading it
    std::vector<int64_t> prompt_ids(ids), one{ids.back()};
    step(prompt_ids, 0);
    step(one, static_cast<int64_t>(ids.size()));
  }

  std::mt19937_64 rng(a.seed);
  spinquant::Utf8Streamer stream;
  int64_t pos = 0;
  std::vector<int64_t> input(ids);
  auto t0 = Clock::now();
  double ttft = 0, prefill_s = 0;
  int generated = 0;
  std::vector<int64_t> out_ids;
  while (generated < a.max_new_tokens && pos + static_cast<int64_t>(input.size()) <= max_seq_len) {
    auto t_step = Clock::now();
    auto result = step(input, pos);
    const auto& logits = result.at(0).toTensor();
    size_t vocab = logits.size(logits.dim() - 1);
    size_t next = sample(logits.const_data_ptr<float>() + (logits.numel() - vocab), vocab, a.temperature, a.top_p, rng);
    pos += input.size();
    if (generated == 0) {
      prefill_s = std::chrono::duration<double>(Clock::now() - t_step).count();
      ttft = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    ++generated;
    out_ids.push_back(next);
    if (a.ids) {
      std::cout << next << (generated < a.max_new_tokens ? " " : "") << std::flush;
    } else {
      std::cout << stream.push(tok.token_bytes(next)) << std::flush;
    }
    if (!a.ignore_eos && eos.count(next)) break;
    input.assign(1, static_cast<int64_t>(next));
  }
  std::cout << (a.ids ? "" : stream.flush()) << std::endl;
  double total = std::chrono::duration<double>(Clock::now() - t0).count();
  double decode_s = total - ttft;
  int decoded = generated - 1;
  fprintf(stderr, "ttft %.0f ms; prefill %zu tok at %.1f tok/s; decode %d tok at %.1f tok/s; peak RSS %.0f MiB\n",
          ttft * 1000, ids.size(), ids.size() / std::max(prefill_s, 1e-9), decoded,
          decoded > 0 ? decoded / std::max(decode_s, 1e-9) : 0.0, peak_rss_mib());
  return 0;
}

}  // namespace

// Transparent huge pages for malloc (spinquant_et/hugepages.py says why and what it measured): where THP
// is `madvise`, glibc uses them only with its glibc.malloc.hugetlb=1 tunable, read when a process starts,
// so the runner starts itself again with it set. A glibc.malloc.hugetlb the user set (=0: off) is kept.
void restart_with_huge_pages(char** argv) {
#if defined(__linux__) && defined(__GLIBC__)
  const char* set = std::getenv("GLIBC_TUNABLES");
  std::string tunables = set ? set : "";
  if (tunables.find("glibc.malloc.hugetlb") != std::string::npos) return;
  std::ifstream mode_file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes((std::istreambuf_iterator<char>(mode_file)), std::istreambuf_iterator<char>());
  if (modes.find("[madvise]") == std::string::npos) return;  // always: already on; never: refused
  tunables += std::string(tunables.empty() ? "" : ":") + "glibc.malloc.hugetlb=1";
  if (setenv("GLIBC_TUNABLES", tunables.c_str(), 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: run on as we are
#else
  (void)argv;
#endif
}

int main(int argc, char** argv) {
  restart_with_huge_pages(argv);
  executorch::runtime::register_pal(executorch::runtime::PalImpl::create(emit_runtime_log, __FILE__));
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }
}
