/* rendezvous_impl.h — the rendezvous store as a Gloo store (internal to src/comm/, C++ only).
 *
 * rendezvous.cc implements nmt_gloo::Store over Gloo's FileStore; its C API (nmt/rendezvous.h)
 * wraps one, and gloo.cc hands one per context to gloo::rendezvous::Context::connectFullMesh,
 * which publishes the context's addresses under key "<rank>" and waits for every other
 * rank's. Gloo's own FileStore waits in whole seconds, cannot be interrupted, and throws a
 * message naming the key file's hash; this store's waits have a deadline to the millisecond,
 * can watch an abort flag, and throw StoreError naming the key, the prefix, the directory and
 * the timeout, which gloo.cc turns into "rank K did not arrive".
 *
 * defines: nmt_gloo::StoreError, nmt_gloo::Store, nmt_gloo::ms_of
 */
#ifndef NMT_COMM_RENDEZVOUS_IMPL_H
#define NMT_COMM_RENDEZVOUS_IMPL_H

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "nmt/status.h"

namespace nmt_gloo {

/* A failure of the store: the nmt status to report (NMT_ERR_ABORTED for a timeout or an
 * abort, NMT_ERR_CONFIG for a key set twice, NMT_ERR_IO for the filesystem), the full message,
 * and the key (without prefix) it concerns, "" if none. */
class StoreError : public std::runtime_error {
 public:
  StoreError(nmt_status status, const std::string &msg, const std::string &key = "")
      : std::runtime_error(msg), status(status), key(key) {}
  nmt_status status;
  std::string key;
};

/* parallel.timeout_s in Gloo's unit (at least 1 ms). */
std::chrono::milliseconds ms_of(double seconds);

class FileStoreKeys; /* FileStore with its existence check made public (rendezvous.cc) */

/* The store over directory `dir` (created if missing), keys under `prefix`. Throws StoreError
 * (NMT_ERR_IO) when the directory cannot be created or used. Every wait, also the one Gloo
 * passes its own timeout to, ends at this store's timeout or when *abort (may be NULL) is
 * non-zero. One instance per thread (Gloo's FileStore keeps an unguarded list of its keys). */
class Store final : public gloo::rendezvous::Store {
 public:
  Store(const std::string &dir, const std::string &prefix, std::chrono::milliseconds timeout,
        const std::atomic<int> *abort);
  ~Store() override;

  void set(const std::string &key, const std::vector<char> &data) override;
  std::vector<char> get(const std::string &key) override;
  void wait(const std::vector<std::string> &keys) override;
  void wait(const std::vector<std::string> &keys,
            const std::chrono::milliseconds &timeout) override;

  /* Whether key is set now (no wait). */
  bool has(const std::string &key);
  void watch(const std::atomic<int> *abort) { abort_ = abort; }
  /* From now on every wait ends at now + timeout, not at its own start + timeout: a phase of
   * several waits (connectFullMesh waits for each peer in turn) is bounded by one timeout. */
  void fix_deadline() {
    deadline_ = std::chrono::steady_clock::now() + timeout_;
    fixed_ = true;
  }
  /* "rendezvous '<dir>' (prefix '<prefix>')" for messages. */
  std::string where() const;
  double timeout_s() const { return (double)timeout_.count() / 1000.0; }

 private:
  std::string full(const std::string &key) const;
  std::unique_ptr<FileStoreKeys> fs_;
  std::string dir_, prefix_;
  std::chrono::milliseconds timeout_;
  const std::atomic<int> *abort_;
  std::chrono::steady_clock::time_point deadline_{};
  bool fixed_ = false;
};

} // namespace nmt_gloo

#endif /* NMT_COMM_RENDEZVOUS_IMPL_H */
