/* rendezvous.cc — the rendezvous store (nmt/rendezvous.h) over Gloo's FileStore, and the same
 * store as a gloo::rendezvous::Store for gloo.cc (rendezvous_impl.h).
 *
 * Values are Gloo FileStore files (written to a temporary name and renamed, so readers never
 * see half a value); this file adds what the FileStore lacks: keys under a prefix, waits with a
 * deadline in milliseconds that can watch an abort flag, write-once keys checked before
 * writing, and errors that say which key was missing for how long. No C++ exception leaves
 * this file through the C API: each entry point catches StoreError, std::bad_alloc and any
 * other std::exception and returns a status.
 */
#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <new>
#include <thread>

#include <gloo/rendezvous/file_store.h>

#include "rendezvous_impl.h"
#include "nmt/rendezvous.h"

namespace nmt_gloo {

/* Polling the directory: start fast (peers usually arrive together), back off to 50 ms so that
 * many ranks waiting on a shared filesystem do not flood its metadata server. */
static const std::chrono::milliseconds kPollFirst(1), kPollMax(50);

class FileStoreKeys : public gloo::rendezvous::FileStore {
 public:
  explicit FileStoreKeys(const std::string &path) : FileStore(path) {}
  bool has(const std::string &key) { return check({key}); }
};

std::chrono::milliseconds ms_of(double seconds) {
  double ms = std::ceil(seconds * 1000.0);
  if (!(ms >= 1.0)) ms = 1.0; /* also NaN */
  if (ms > 1e15) ms = 1e15;   /* ~30000 years: no overflow in the clock arithmetic */
  return std::chrono::milliseconds((long long)ms);
}

/* mkdir -p: every component, tolerating ones that exist (another node may create them at the
 * same time). */
static void make_dirs(const std::string &dir) {
  std::string part;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    part = dir.substr(0, pos);
    if (part.empty() || part == "/") continue;
    if (mkdir(part.c_str(), 0777) != 0 && errno != EEXIST)
      throw StoreError(NMT_ERR_IO, "rendezvous '" + dir + "': cannot create directory '" + part +
                                       "': " + strerror(errno));
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0)
    throw StoreError(NMT_ERR_IO, "rendezvous '" + dir + "': " + strerror(errno));
  if (!S_ISDIR(st.st_mode))
    throw StoreError(NMT_ERR_IO, "rendezvous '" + dir + "': not a directory");
  if (access(dir.c_str(), R_OK | W_OK | X_OK) != 0)
    throw StoreError(NMT_ERR_IO, "rendezvous '" + dir + "': " + strerror(errno) +
                                     " (every node needs to read and write it)");
}

Store::Store(const std::string &dir, const std::string &prefix,
             std::chrono::milliseconds timeout, const std::atomic<int> *abort)
    : dir_(dir), prefix_(prefix), timeout_(timeout), abort_(abort) {
  make_dirs(dir);
  try {
    fs_.reset(new FileStoreKeys(dir));
  } catch (const std::bad_alloc &) {
    throw;
  } catch (const std::exception &e) {
    throw StoreError(NMT_ERR_IO, "rendezvous '" + dir + "': " + e.what());
  }
}

Store::~Store() = default;

std::string Store::where() const {
  return "rendezvous '" + dir_ + "' (prefix '" + prefix_ + "')";
}

std::string Store::full(const std::string &key) const {
  return prefix_.empty() ? key : prefix_ + "/" + key;
}

bool Store::has(const std::string &key) {
  try {
    return fs_->has(full(key));
  } catch (const std::bad_alloc &) {
    throw;
  } catch (const std::exception &e) {
    /* FileStore::check enforces that a key file is either readable or absent. */
    throw StoreError(NMT_ERR_IO, where() + ": cannot check key '" + key + "': " + e.what(), key);
  }
}

void Store::set(const std::string &key, const std::vector<char> &data) {
  /* FileStore::set checks too, but only with an assertion naming the file's hash. The check
   * and the write are not atomic: two writers of one key can both pass it, which is the
   * misconfiguration (two processes with one node rank) this message is about. */
  if (has(key))
    throw StoreError(NMT_ERR_CONFIG,
                     where() + ": key '" + key + "' is already set: a stale rendezvous "
                     "directory from an earlier run (give this run a fresh parallel.rendezvous) "
                     "or two processes with the same parallel.node_rank", key);
  try {
    fs_->set(full(key), data);
  } catch (const std::bad_alloc &) {
    throw;
  } catch (const std::exception &e) {
    throw StoreError(NMT_ERR_IO, where() + ": cannot write key '" + key + "': " + e.what(), key);
  }
}

std::vector<char> Store::get(const std::string &key) {
  wait({key});
  try {
    return fs_->get(full(key));
  } catch (const std::bad_alloc &) {
    throw;
  } catch (const std::exception &e) {
    throw StoreError(NMT_ERR_IO, where() + ": cannot read key '" + key + "': " + e.what(), key);
  }
}

void Store::wait(const std::vector<std::string> &keys) {
  const auto deadline = fixed_ ? deadline_ : std::chrono::steady_clock::now() + timeout_;
  auto pause = kPollFirst;
  for (;;) {
    std::string missing;
    for (const auto &k : keys)
      if (!has(k)) {
        missing = k;
        break;
      }
    if (missing.empty()) return;
    if (abort_ && abort_->load(std::memory_order_relaxed))
      throw StoreError(NMT_ERR_ABORTED,
                       where() + ": aborted while waiting for key '" + missing + "'", missing);
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      char secs[32];
      snprintf(secs, sizeof secs, "%g", timeout_s());
      throw StoreError(NMT_ERR_ABORTED,
                       where() + ": key '" + missing + "' not set within " + secs +
                           " s (parallel.timeout_s): the process that publishes it has not "
                           "arrived (not started, failed, or using another rendezvous)",
                       missing);
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, kPollMax);
  }
}

/* Gloo passes its context timeout, which gloo.cc sets to this store's: one deadline rule for
 * every wait, and one message. */
void Store::wait(const std::vector<std::string> &keys, const std::chrono::milliseconds &) {
  wait(keys);
}

} // namespace nmt_gloo

/* ---- C API ---- */

struct nmt_rendezvous {
  std::unique_ptr<nmt_gloo::Store> store;
};

/* Runs f, turning every exception into a status with its message recorded. */
template <class F> static nmt_status guarded(const char *what, F &&f) {
  try {
    f();
    return NMT_OK;
  } catch (const nmt_gloo::StoreError &e) {
    return nmt_errorf(e.status, "%s", e.what());
  } catch (const std::bad_alloc &) {
    return nmt_errorf(NMT_ERR_NOMEM, "%s: out of memory", what);
  } catch (const std::exception &e) {
    return nmt_errorf(NMT_ERR_IO, "%s: %s", what, e.what());
  } catch (...) {
    return nmt_errorf(NMT_ERR_INTERNAL, "%s: unknown C++ exception", what);
  }
}

extern "C" nmt_status nmt_rendezvous_open(const char *path, const char *prefix, double timeout_s,
                                          nmt_rendezvous **out) {
  if (!out) return nmt_errorf(NMT_ERR_INTERNAL, "nmt_rendezvous_open: NULL out");
  *out = nullptr;
  if (!path || !*path)
    return nmt_errorf(NMT_ERR_CONFIG, "parallel.rendezvous: empty path (a directory every node "
                      "can read and write)");
  if (!(timeout_s > 0))
    return nmt_errorf(NMT_ERR_CONFIG, "parallel.timeout_s = %g: must be > 0 (seconds)",
                      timeout_s);
  nmt_rendezvous *rv = new (std::nothrow) nmt_rendezvous;
  if (!rv) return nmt_errorf(NMT_ERR_NOMEM, "nmt_rendezvous_open: out of memory");
  nmt_status st = guarded("rendezvous open", [&] {
    rv->store.reset(new nmt_gloo::Store(path, prefix ? prefix : "", nmt_gloo::ms_of(timeout_s),
                                        nullptr));
  });
  if (st != NMT_OK) {
    delete rv;
    return st;
  }
  *out = rv;
  return NMT_OK;
}

extern "C" void nmt_rendezvous_watch(nmt_rendezvous *rv, const atomic_int *abort) {
  if (rv) rv->store->watch(abort);
}

extern "C" nmt_status nmt_rendezvous_set(nmt_rendezvous *rv, const char *key, const void *bytes,
                                         size_t len) {
  if (!rv || !key || !*key || !bytes || len == 0)
    return nmt_errorf(NMT_ERR_INTERNAL, "nmt_rendezvous_set: NULL handle, empty key, NULL bytes "
                      "or empty value (key '%s', %zu bytes)", key ? key : "(null)", len);
  return guarded("rendezvous set", [&] {
    const char *p = (const char *)bytes;
    rv->store->set(key, std::vector<char>(p, p + len));
  });
}

extern "C" nmt_status nmt_rendezvous_get(nmt_rendezvous *rv, const char *key, void *buf,
                                         size_t cap, size_t *len) {
  if (!rv || !key || !*key || !len || (!buf && cap))
    return nmt_errorf(NMT_ERR_INTERNAL, "nmt_rendezvous_get: NULL handle, empty key, NULL len "
                      "or NULL buf (key '%s')", key ? key : "(null)");
  std::vector<char> v;
  NMT_TRY(guarded("rendezvous get", [&] { v = rv->store->get(key); }));
  *len = v.size();
  if (v.size() > cap)
    return nmt_errorf(NMT_ERR_INTERNAL, "%s: key '%s' holds %zu bytes, the buffer %zu",
                      rv->store->where().c_str(), key, v.size(), cap);
  if (!v.empty()) memcpy(buf, v.data(), v.size());
  return NMT_OK;
}

extern "C" void nmt_rendezvous_close(nmt_rendezvous *rv) { delete rv; }
