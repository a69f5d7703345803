/* nmt/rendezvous.h — a key-value store on a shared filesystem, where the processes of one run
 * (one per node) meet before they train together.
 *
 * parallel.rendezvous names a directory every node can read and write (NFS, Lustre, a local
 * directory when all processes run on one machine). A value is one file, written under a
 * temporary name and renamed into place (Gloo's FileStore, gloo/rendezvous/file_store.h, whose
 * files these are), so a reader sees either nothing or the whole value. Keys live under a
 * prefix, so several groups (or runs) can share a directory as long as their prefixes differ.
 * Keys are write-once: setting a key that exists is an error, because a value left by an
 * earlier run would otherwise be read as this run's (an old ncclUniqueId, an old config hash).
 * A reader waits for a key up to the store's timeout, polling the directory (1 ms, doubling to
 * 50 ms: inotify does not see other nodes' writes on NFS), and fails with a message naming the
 * key and the timeout instead of hanging.
 *
 * The engine uses it to publish rank 0's ncclUniqueId, to check that every node runs the same
 * config on the same number of devices (each node publishes a hash of its effective config and
 * its device count under its own key, and every node compares), and the Gloo communicator
 * (nmt/comm.h, nmt_comm_create_gloo) connects its contexts through the same directory.
 * docs/multinode.md, "Gloo communicator and rendezvous", describes both.
 *
 * Thread safety: one nmt_rendezvous per thread (the handles of several threads, or processes,
 * may share a directory and prefix; that is the point).
 *
 * defines: nmt_rendezvous, nmt_rendezvous_open, nmt_rendezvous_watch, nmt_rendezvous_set,
 *          nmt_rendezvous_get, nmt_rendezvous_close
 */
#ifndef NMT_RENDEZVOUS_H
#define NMT_RENDEZVOUS_H

#include <stddef.h>

#include "nmt/atomic.h" /* atomic_int in C and C++ */

#include "nmt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct nmt_rendezvous nmt_rendezvous;

/* Opens the store in directory `path` (created with its parents if missing, mode 0777 minus
 * the umask), keys under `prefix` (NULL or "" for none; any string: keys and prefix are hashed
 * into file names), waits bounded by timeout_s seconds (> 0; parallel.timeout_s).
 * Errors: NMT_ERR_CONFIG for an empty path or a timeout_s that is not > 0 (naming
 * parallel.rendezvous / parallel.timeout_s); NMT_ERR_IO naming the path and the system's
 * reason when the directory cannot be created, is not a directory or is not writable;
 * NMT_ERR_NOMEM. *out is NULL on error. */
nmt_status nmt_rendezvous_open(const char *path, const char *prefix, double timeout_s,
                               nmt_rendezvous **out);

/* Makes waits of this handle also end once *abort is non-zero (the run's abort flag, raised
 * by a stop signal or a failed thread); NULL stops watching. The flag is polled between
 * polls of the directory, so a wait ends within ~50 ms of the flag being raised. */
void nmt_rendezvous_watch(nmt_rendezvous *rv, const atomic_int *abort);

/* Publishes bytes[0, len) under key (NUL-terminated, non-empty). len >= 1: Gloo's FileStore
 * cannot read back an empty value.
 * Errors: NMT_ERR_CONFIG when the key is already set (message: the key, the directory, and
 * the two usual causes: a stale directory from an earlier run, or two processes with the same
 * node rank); NMT_ERR_IO when the file cannot be written (the path and the reason);
 * NMT_ERR_INTERNAL for a NULL/empty key, NULL bytes or len 0. */
nmt_status nmt_rendezvous_set(nmt_rendezvous *rv, const char *key, const void *bytes, size_t len);

/* Waits until key is set (up to the timeout given to nmt_rendezvous_open), then copies its
 * value into buf[0, cap) and its length into *len.
 * Errors: NMT_ERR_ABORTED when the key is not set within the timeout (message: the key, the
 * prefix, the directory and the timeout in seconds) or the watched abort flag is raised;
 * NMT_ERR_INTERNAL when the value is longer than cap (*len then holds its length, so the caller
 * can retry with a larger buffer) or for a NULL/empty key, NULL len or NULL buf with cap > 0;
 * NMT_ERR_IO when the file cannot be read. */
nmt_status nmt_rendezvous_get(nmt_rendezvous *rv, const char *key, void *buf, size_t cap,
                              size_t *len);

/* Frees the handle (NULL is a no-op). The files stay: other processes may still read them. */
void nmt_rendezvous_close(nmt_rendezvous *rv);

#ifdef __cplusplus
}
#endif
#endif /* NMT_RENDEZVOUS_H */
