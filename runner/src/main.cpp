// spinquant-run: generate text with a spinquant-et .pte, with no Python and no libtorch.
//
//   spinquant-run --model model.pte [--tokenizer tokenizer.json] --prompt "..." [--chat]
//                 [--max-new-tokens N] [sampling flags] [--threads K]
//                 [--ids] [--ignore-eos] [--warmup] [--no-weight-cache] [--verbose]
//   spinquant-run --model model.pte --interactive [--system TEXT] [--stop-when-full] ...  (multi-turn chat)
//   spinquant-run --tokenizer tokenizer.json --encode FILE     (prints the token ids of FILE)
//
// Prefill runs the whole prompt in one forward call, then one token per call; the KV cache lives
// in the program's mutable buffers. Text streams to stdout; time to first token, prefill and
// decode tokens/s and peak RSS go to stderr. Errors are one line on stderr and exit code 2.
// --interactive reads one user turn per line from stdin and keeps the conversation in the KV cache, as
// spinquant_et/chat.py does (same chat.json pieces, same turn budget, same notices).
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
#include <functional>
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

#include "sampling.h"
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
  std::string model, tokenizer, prompt, encode, system;
  bool chat = false, ids = false, ignore_eos = false, warmup = false, weight_cache = true;
  bool interactive = false, has_system = false, stop_when_full = false, has_prompt = false;
  int max_new_tokens = 128, threads = 2;
  spinquant::SamplingConfig sampling;
};

const char* kUsage =
    "usage: spinquant-run --model model.pte [--tokenizer tokenizer.json] --prompt TEXT [--chat]\n"
    "                     [--max-new-tokens 128] [--threads 2] [sampling flags]\n"
    "                     [--ids] [--ignore-eos] [--warmup] [--no-weight-cache] [--verbose]\n"
    "       spinquant-run --model model.pte --interactive [--system TEXT] [--stop-when-full] [sampling flags]\n"
    "       spinquant-run --tokenizer tokenizer.json --encode FILE\n"
    "sampling, in llama.cpp's order and meaning (the same tokens as `spinquant-et generate` for a seed):\n"
    "  --repeat-penalty 1 (1: off) over --repeat-last-n 64 tokens, --top-k 0 (0: all), --top-p 0.9,\n"
    "  --min-p 0 (0: off), --temperature 0 (0: greedy), --seed 0\n"
    "--interactive: a chat, one user turn per line of stdin (a terminal or a pipe), each wrapped in chat.json's\n"
    "template; the conversation stays in the KV cache (only the new turn is prefilled); /reset starts over,\n"
    "/exit or end of input ends; a stats line per turn on stderr. A turn that does not fit drops the oldest\n"
    "turns and prefills the rest again (--stop-when-full ends the chat instead); each turn keeps room for\n"
    "--max-new-tokens of reply, up to a quarter of the context. --system TEXT replaces the default system prompt.\n"
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
      else if (k == "--prompt") {
        a.prompt = value();
        a.has_prompt = true;
      }
      else if (k == "--encode") a.encode = value();
      else if (k == "--chat") a.chat = true;
      else if (k == "--ids") a.ids = true;
      else if (k == "--ignore-eos") a.ignore_eos = true;
      else if (k == "--warmup") a.warmup = true;
      else if (k == "--no-weight-cache") a.weight_cache = false;
      else if (k == "--verbose" || k == "-v") g_verbose = true;  // read by the log handler
      else if (k == "--max-new-tokens") a.max_new_tokens = std::stoi(value());
      else if (k == "--threads") a.threads = std::stoi(value());
      else if (k == "--temperature") a.sampling.temperature = std::stod(value());
      else if (k == "--top-p") a.sampling.top_p = std::stod(value());
      else if (k == "--top-k") a.sampling.top_k = std::stoi(value());
      else if (k == "--min-p") a.sampling.min_p = std::stod(value());
      else if (k == "--repeat-penalty") a.sampling.repeat_penalty = std::stod(value());
      else if (k == "--repeat-last-n") a.sampling.repeat_last_n = std::stoi(value());
      else if (k == "--seed") a.sampling.seed = std::stoull(value());
      else if (k == "--interactive" || k == "-i") a.interactive = true;
      else if (k == "--stop-when-full") a.stop_when_full = true;
      else if (k == "--system") {
        a.system = value();
        a.has_system = true;
      }
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
  const auto& c = a.sampling;
  if (c.temperature < 0) throw Fail("--temperature must be >= 0 (0 = greedy)");
  if (c.top_k < 0) throw Fail("--top-k must be >= 0 (0 = off)");
  if (!(c.top_p > 0 && c.top_p <= 1)) throw Fail("--top-p must be in (0, 1] (1 = off)");
  if (!(c.min_p >= 0 && c.min_p < 1)) throw Fail("--min-p must be in [0, 1) (0 = off)");
  if (!(c.repeat_penalty > 0)) throw Fail("--repeat-penalty must be > 0 (1 = off)");
  if (c.repeat_last_n < 0) throw Fail("--repeat-last-n must be >= 0");
  if (a.max_new_tokens < 1) throw Fail("--max-new-tokens must be >= 1");
  if (a.interactive && a.has_prompt) throw Fail("--interactive reads its turns from stdin; drop --prompt");
  if (a.has_system && !a.interactive) throw Fail("--system is for --interactive chats");
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

// The stats line on stderr after a reply (one per turn in a chat).
void print_stats(double ttft_s, size_t prompt_tokens, double prefill_s, int decoded, double decode_s) {
  fprintf(stderr, "ttft %.0f ms; prefill %zu tok at %.1f tok/s; decode %d tok at %.1f tok/s; peak RSS %.0f MiB\n",
          ttft_s * 1000, prompt_tokens, prompt_tokens / std::max(prefill_s, 1e-9), std::max(decoded, 0),
          decoded > 0 ? decoded / std::max(decode_s, 1e-9) : 0.0, peak_rss_mib());
}

// The chat template as literal text around messages, as `spinquant-et export` renders it into chat.json
// (spinquant_et/chat.py says what each piece is).
struct ChatTemplate {
  std::string prefix, suffix, turn_prefix, system_prefix, system_suffix;
  bool has_turns = false, has_system = false;
};

ChatTemplate read_chat_template(const std::string& tokenizer_path) {
  auto slash = tokenizer_path.find_last_of('/');
  std::string path = (slash == std::string::npos ? std::string() : tokenizer_path.substr(0, slash + 1)) + "chat.json";
  std::ifstream f(path);
  if (!f) throw Fail("no chat template (" + path + "); drop --chat or re-export the model");
  ChatTemplate t;
  try {
    auto j = nlohmann::json::parse(f);
    t.prefix = j.at("prefix").get<std::string>();
    t.suffix = j.at("suffix").get<std::string>();
    if (j.contains("turn_prefix")) {
      t.turn_prefix = j.at("turn_prefix").get<std::string>();
      t.has_turns = true;
    }
    if (j.contains("system_prefix") && j.contains("system_suffix")) {
      t.system_prefix = j.at("system_prefix").get<std::string>();
      t.system_suffix = j.at("system_suffix").get<std::string>();
      t.has_system = true;
    }
  } catch (const nlohmann::json::exception&) {
    throw Fail(path + " is not a chat template spinquant-et wrote; re-export the model");
  }
  return t;
}

// One forward call of the tokens at a start position, then the sampled next token (history: the context's ids).
using NextToken = std::function<int64_t(std::vector<int64_t>&, int64_t, const std::vector<int64_t>&)>;

std::string trimmed(const std::string& s) {
  const char* space = " \t\r\n";
  auto b = s.find_first_not_of(space);
  return b == std::string::npos ? std::string() : s.substr(b, s.find_last_not_of(space) - b + 1);
}

// --interactive: the conversation of spinquant_et.chat.ChatSession, turn for turn.
int chat(const Args& a, const spinquant::Tokenizer& tok, int64_t max_seq_len, const std::set<int64_t>& eos,
         const NextToken& next_token) {
  const ChatTemplate t = read_chat_template(a.tokenizer);
  if (!t.has_turns)
    throw Fail("chat.json has no multi-turn template (written by an older spinquant-et, or the template rewrites "
               "earlier turns); re-export the model, or use --prompt --chat");
  if (a.has_system && !t.has_system) throw Fail("this model's chat template has no system role; drop --system");
  const std::string header = a.has_system ? t.system_prefix + a.system + t.system_suffix : t.prefix;
  // each turn keeps room for its reply: --max-new-tokens, at most a quarter of the context
  const int64_t reply_room = std::max<int64_t>(1, std::min<int64_t>(a.max_new_tokens, max_seq_len / 4));
  const bool penalize = a.sampling.repeat_penalty != 1.0;
  struct Turn {
    std::string user;
    std::vector<int64_t> reply;  // without its end-of-turn token
  };
  std::vector<Turn> turns;
  std::vector<int64_t> context;  // the conversation's ids; the KV cache holds the first `filled`
  int64_t filled = 0;
  auto append = [](std::vector<int64_t>& to, const std::vector<int64_t>& more) { to.insert(to.end(), more.begin(), more.end()); };
  // the ids of turns[from..] and a new user message, from the start of the conversation
  auto rebuild = [&](size_t from, const std::string& user) {
    std::vector<int64_t> ids = tok.encode(header + (from < turns.size() ? turns[from].user : user) + t.suffix);
    for (size_t i = from; i < turns.size(); ++i) {
      append(ids, turns[i].reply);
      append(ids, tok.encode(t.turn_prefix + (i + 1 < turns.size() ? turns[i + 1].user : user) + t.suffix));
    }
    return ids;
  };
  const bool tty = isatty(STDIN_FILENO);
  if (tty) std::cerr << "chat: one line per turn; /reset starts over, /exit or Ctrl-D ends\n";
  std::string line;
  while (true) {
    if (tty) std::cerr << "> " << std::flush;
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::string command = trimmed(line);
    if (command == "/exit") break;
    if (command == "/reset") {
      turns.clear();
      context.clear();
      filled = 0;
      std::cerr << "note: conversation reset\n";
      continue;
    }
    if (command.empty()) continue;
    std::vector<int64_t> ids;
    int64_t start = 0;
    if (!turns.empty()) {
      ids = context;
      append(ids, tok.encode(t.turn_prefix + line + t.suffix));
      start = filled;
    } else {
      ids = rebuild(0, line);
    }
    size_t dropped = 0;
    if (static_cast<int64_t>(ids.size()) + reply_room > max_seq_len) {
      if (!turns.empty() && a.stop_when_full) {
        std::cerr << "note: the conversation fills the program's context of " << max_seq_len
                  << " tokens; the chat ends (--stop-when-full)\n";
        break;
      }
      // the fewest oldest turns whose drop makes room (with no earlier turn, ids are already the first turn's)
      for (dropped = 1; dropped <= turns.size(); ++dropped) {
        ids = rebuild(dropped, line);
        if (static_cast<int64_t>(ids.size()) + reply_room <= max_seq_len) break;
      }
      dropped = std::min(dropped, turns.size());
      start = 0;
      if (static_cast<int64_t>(ids.size()) >= max_seq_len) {
        std::cerr << "error: this turn has " << ids.size() << " tokens with the chat template but the program's context is "
                  << max_seq_len << "; shorten it (the conversation goes on without it)" << std::endl;
        continue;
      }
      if (dropped)
        std::cerr << "note: context full (" << max_seq_len << " tokens): dropped the oldest " << dropped
                  << " turn(s); prefilling the remaining " << ids.size() << " tokens again" << std::endl;
      turns.erase(turns.begin(), turns.begin() + dropped);
    }
    std::vector<int64_t> history(penalize ? ids : std::vector<int64_t>());
    std::vector<int64_t> input(ids.begin() + start, ids.end());
    auto t0 = Clock::now();
    int64_t next = next_token(input, start, history);
    const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
    int64_t pos = static_cast<int64_t>(ids.size());
    std::vector<int64_t> reply;
    spinquant::Utf8Streamer stream;
    auto t1 = Clock::now();
    while (!eos.count(next)) {
      reply.push_back(next);
      if (a.ids) std::cout << (reply.size() > 1 ? " " : "") << next << std::flush;
      else std::cout << stream.push(tok.token_bytes(next)) << std::flush;
      if (static_cast<int>(reply.size()) >= a.max_new_tokens) break;
      if (pos >= max_seq_len) {  // no position left to feed it
        std::cerr << "\nnote: the reply reached the end of the program's context (" << max_seq_len << " tokens)\n";
        break;
      }
      if (penalize) history.push_back(next);
      std::vector<int64_t> one{next};
      next = next_token(one, pos, history);
      ++pos;
    }
    std::cout << (a.ids ? "" : stream.flush()) << std::endl;
    const double decode_s = std::chrono::duration<double>(Clock::now() - t1).count();
    const int decoded = static_cast<int>(reply.size()) - 1;
    print_stats(prefill_s, input.size(), prefill_s, decoded, decode_s);
    turns.push_back({line, reply});
    context = ids;
    append(context, reply);
    filled = pos;
  }
  return 0;
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

  // One call: `input` at position `start`, then sample the next token from the last position's logits.
  spinquant::SplitMix64 rng(a.sampling.seed);
  auto next_token = [&](std::vector<int64_t>& input, int64_t start, const std::vector<int64_t>& history) {
    auto result = step(input, start);
    const auto& logits = result.at(0).toTensor();
    size_t vocab = logits.size(logits.dim() - 1);
    return static_cast<int64_t>(spinquant::sample_token(logits.const_data_ptr<float>() + (logits.numel() - vocab),
                                                        vocab, a.sampling, rng, history));
  };
  const bool penalize = a.sampling.repeat_penalty != 1.0;

  if (a.interactive) return chat(a, tok, max_seq_len, eos, next_token);

  std::string prompt = a.prompt;
  if (a.chat) {
    ChatTemplate t = read_chat_template(a.tokenizer);
    prompt = t.prefix + a.prompt + t.suffix;
  }
  std::vector<int64_t> ids = tok.encode(prompt);
  if (ids.empty()) throw Fail("the prompt is empty");
  if (static_cast<int64_t>(ids.size()) > max_seq_len - 1)
    throw Fail("the prompt has " + std::to_string(ids.size()) + " tokens but the program's context is " +
               std::to_string(max_seq_len) + "; shorten it or re-export with a larger --max-seq-len");
  if (a.warmup) {  // the prompt fits with a position to spare (checked above)
    // the timed run writes every position it reads again before reading it
    std::vector<int64_t> prompt_ids(ids), one{ids.back()};
    step(prompt_ids, 0);
    step(one, static_cast<int64_t>(ids.size()));
  }

  spinquant::Utf8Streamer stream;
  int64_t pos = 0;
  std::vector<int64_t> input(ids), history(penalize ? ids : std::vector<int64_t>());
  auto t0 = Clock::now();
  double ttft = 0, prefill_s = 0;
  int generated = 0;
  while (generated < a.max_new_tokens && pos + static_cast<int64_t>(input.size()) <= max_seq_len) {
    auto t_step = Clock::now();
    int64_t next = next_token(input, pos, history);
    pos += input.size();
    if (generated == 0) {
      prefill_s = std::chrono::duration<double>(Clock::now() - t_step).count();
      ttft = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    ++generated;
    if (penalize) history.push_back(next);
    if (a.ids) {
      std::cout << next << (generated < a.max_new_tokens ? " " : "") << std::flush;
    } else {
      std::cout << stream.push(tok.token_bytes(next)) << std::flush;
    }
    if (!a.ignore_eos && eos.count(next)) break;
    input.assign(1, next);
  }
  std::cout << (a.ids ? "" : stream.flush()) << std::endl;
  double total = std::chrono::duration<double>(Clock::now() - t0).count();
  double decode_s = total - ttft;
  int decoded = generated - 1;
  print_stats(ttft, ids.size(), prefill_s, decoded, decode_s);
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
