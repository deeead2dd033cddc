#include "megatrain/common/tuning.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

namespace megatrain {
namespace common {
namespace {

std::atomic<bool> g_hugepages{true};
std::atomic<bool> g_store_skew{true};
std::atomic<bool> g_nt_stores{true};
std::atomic<int64_t> g_nt_min_numel{int64_t{1} << 20};
std::atomic<int64_t> g_prefetch_bytes{1024};
std::once_flag g_env_once;

bool env_bool(const char* name, bool dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  const std::string s(v);
  if (s == "1" || s == "on" || s == "true" || s == "yes") return true;
  if (s == "0" || s == "off" || s == "false" || s == "no") return false;
  throw std::invalid_argument(std::string(name) + " must be 0 or 1, got '" + s + "'");
}

int64_t env_int(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == std::string(v).size()) return static_cast<int64_t>(x);
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(std::string(name) + " must be an integer, got '" + v + "'");
}

void check(const Tuning& t) {
  if (t.nt_min_numel < 0) {
    throw std::invalid_argument("nt_min_numel must be >= 0, got " + std::to_string(t.nt_min_numel));
  }
  if (t.prefetch_bytes < 0 || t.prefetch_bytes > 65536) {
    throw std::invalid_argument("prefetch_bytes must be in [0, 65536], got " +
                                std::to_string(t.prefetch_bytes));
  }
}

void store(const Tuning& t) {
  g_hugepages.store(t.hugepages);
  g_store_skew.store(t.store_skew);
  g_nt_stores.store(t.nt_stores);
  g_nt_min_numel.store(t.nt_min_numel);
  g_prefetch_bytes.store(t.prefetch_bytes);
}

void init_from_env() {
  std::call_once(g_env_once, [] {
    Tuning t;
    t.hugepages = env_bool("MEGATRAIN_HUGEPAGES", t.hugepages);
    t.store_skew = env_bool("MEGATRAIN_STORE_SKEW", t.store_skew);
    t.nt_stores = env_bool("MEGATRAIN_ADAM_NT_STORES", t.nt_stores);
    t.nt_min_numel = env_int("MEGATRAIN_ADAM_NT_MIN_NUMEL", t.nt_min_numel);
    t.prefetch_bytes = env_int("MEGATRAIN_ADAM_PREFETCH", t.prefetch_bytes);
    check(t);
    store(t);
  });
}

}  // namespace

Tuning tuning() {
  init_from_env();
  Tuning t;
  t.hugepages = g_hugepages.load();
  t.store_skew = g_store_skew.load();
  t.nt_stores = g_nt_stores.load();
  t.nt_min_numel = g_nt_min_numel.load();
  t.prefetch_bytes = g_prefetch_bytes.load();
  return t;
}

void set_tuning(const Tuning& t) {
  check(t);
  init_from_env();  // so a later first tuning() cannot overwrite these with the environment
  store(t);
}

}  // namespace common
}  // namespace megatrain
