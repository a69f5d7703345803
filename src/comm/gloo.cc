/* gloo.cc — the Gloo communicator (nmt/comm.h, nmt_comm_create_gloo): CPU worker ranks spread
 * over several processes (one per node), behind the same nmt_comm table as the host and NCCL
 * communicators. Gloo (Debian libgloo-dev, the collective library PyTorch uses for CPU
 * tensors) moves the bytes over its TCP transport; docs/multinode.md has the picture.
 *
 * Setup: one tcp device per process (one epoll thread, bound to the interface or host given),
 * one gloo::rendezvous::Context per local rank, connected to every other rank by
 * connectFullMesh through the rendezvous store (rendezvous_impl.h). The local contexts connect
 * on one thread each, at the same time: each publishes its addresses and then waits for every
 * other rank's, its process-mates' included.
 *
 * Collectives run on the calling worker thread, synchronously, like the host communicator's:
 *   allreduce_sum, allreduce_max, allreduce_sum_as  gloo::allreduce (ring), in place; a half
 *                     wire copies buf into the rank's reserved uint16 scratch and reduces that
 *                     with a custom function (decode, add in fp32, round: the correctly
 *                     rounded half addition), then decodes back.
 *   reduce_scatter_sum_as  the reduce-scatter half of that ring (ring_reduce_scatter), written
 *                     over Gloo's unbound buffers (send, recv, waits with the timeout), in place
 *                     on the n x count buffer or the half scratch. Gloo 0.5 has no ring
 *                     reduce-scatter of its own; its halving-doubling one (old API) would do,
 *                     but it sends and receives its notifications through one shared byte (a
 *                     data race ThreadSanitizer reports in every make test-tsan), sizes its
 *                     buffers in int bytes (2 GiB per call) and allocates twice the buffer on
 *                     every call.
 *   all_gather        gloo::allgather in place (slice r is rank r's contribution).
 *   broadcast         gloo::broadcast in place; barrier gloo::barrier.
 * Every wait inside Gloo ends at parallel.timeout_s (the options' timeout_s): a peer that
 * dies closes its sockets, and Gloo fails the operations pending on them at once; a peer that
 * stalls is a timeout. Either is NMT_ERR_ABORTED.
 *
 * Abort: the 2022 Gloo this builds against has no abort call. Its one public path that fails
 * every pending operation of a context is an application timeout: a waitRecv that times out
 * makes the transport context signal all its pairs (tcp::Context::signalException), which
 * wakes every waiter with an exception and closes the sockets, so the peers in other
 * processes fail at once too. nmt_comm_abort provokes one on each local context (a zero-byte
 * buffer waited on for 0 ms: "poison"), and a watcher thread does the same within ~20 ms of
 * the run's abort flag being raised. A rank whose collective fails poisons its own context
 * the same way, so the failure reaches its process-mates and peers without waiting for their
 * timeouts. A poisoned context is never used again: the group must be destroyed.
 *
 * SIGPIPE: Gloo writes to sockets with writev(2), which raises SIGPIPE when the peer has gone;
 * its default action would kill this process before Gloo could report the error, so creating
 * a group sets SIGPIPE to SIG_IGN when it is at its default (as Python does at startup).
 */
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <string.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "comm_impl.h"
#include "nmt/comm.h"
#include "nmt/half.h"
#include "rendezvous_impl.h"

namespace {

/* The slot prefix of the reduce-scatter, next to Gloo's own (gloo/types.h: 0x01..0x08). */
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;

struct gloo_group;

/* One rank's handle. Standard layout with base first, so a nmt_comm * is a gloo_rank *. */
struct gloo_rank {
  nmt_comm base;
  gloo_group *g;
  int local; /* index into the group's per-rank state */
};

/* What a local rank owns besides its handle; touched by its own thread only, except the two
 * flags (any thread) and ctx when another thread poisons it (Gloo locks inside). */
struct rank_state {
  std::shared_ptr<gloo::Context> ctx;
  std::vector<uint16_t> wire; /* half scratch: nmt_comm_reserve's max_count elements */
  std::vector<char> tmp;      /* reduce-scatter's receive buffer: one chunk, grown on demand */
  std::atomic<bool> connected{false};
  std::atomic<bool> poisoned{false};
};

struct gloo_group {
  std::atomic<int> own_abort{0};
  std::atomic<int> *abort = nullptr; /* the run's flag, or &own_abort */
  std::atomic<int> failed{0};        /* a local rank's collective has failed */
  int n_local = 0;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<gloo::transport::Device> dev; /* declared before the contexts that use it */
  std::unique_ptr<rank_state[]> st;
  std::unique_ptr<gloo_rank[]> ranks;
  /* watcher of the run's abort flag */
  std::thread watcher;
  std::mutex watch_mu;
  std::condition_variable watch_cv;
  bool watch_stop = false; /* guarded by watch_mu */
};

inline bool aborted(const gloo_group *g) {
  return g->abort->load(std::memory_order_relaxed) != 0;
}

/* Fails every pending and future operation of a connected context, through Gloo's own
 * application-timeout path (see the file comment). Thread-safe; once per context. */
void poison(gloo_group *g, int i) {
  rank_state &s = g->st[i];
  if (!s.connected.load() || s.poisoned.exchange(true)) return;
  char byte = 0;
  try {
    auto buf = s.ctx->createUnboundBuffer(&byte, 0);
    buf->waitRecv(std::chrono::milliseconds(0));
  } catch (...) {
    /* the IoException this provokes, or the context's earlier one */
  }
}

void poison_all(gloo_group *g) {
  for (int i = 0; i < g->n_local; i++) poison(g, i);
}

void watch_abort(gloo_group *g) {
  std::unique_lock<std::mutex> lk(g->watch_mu);
  while (!g->watch_stop) {
    if (aborted(g)) {
      lk.unlock();
      poison_all(g);
      return;
    }
    g->watch_cv.wait_for(lk, std::chrono::milliseconds(20));
  }
}

/* ---- reductions (Gloo calls fn(c, a, b, n): c[i] = a[i] op b[i], c may be a) ---- */

void sum_f32(void *c, const void *a, const void *b, size_t n) {
  float *o = static_cast<float *>(c);
  const float *x = static_cast<const float *>(a), *y = static_cast<const float *>(b);
  for (size_t i = 0; i < n; i++) o[i] = x[i] + y[i];
}

/* NaN is sticky (a NaN in either operand wins), as in the host communicator's max. */
void max_f32(void *c, const void *a, const void *b, size_t n) {
  float *o = static_cast<float *>(c);
  const float *x = static_cast<const float *>(a), *y = static_cast<const float *>(b);
  for (size_t i = 0; i < n; i++) o[i] = (y[i] > x[i] || y[i] != y[i]) ? y[i] : x[i];
}

/* The half sums: decode, add in fp32, round once. Both operands are halves, so the fp32 sum
 * rounded to the wire type is the correctly rounded half sum (nmt/comm.h, Figueroa 1995). */
void sum_fp16(void *c, const void *a, const void *b, size_t n) {
  uint16_t *o = static_cast<uint16_t *>(c);
  const uint16_t *x = static_cast<const uint16_t *>(a), *y = static_cast<const uint16_t *>(b);
  for (size_t i = 0; i < n; i++)
    o[i] = nmt_half_fp16_bits(nmt_half_fp16_value(x[i]) + nmt_half_fp16_value(y[i]));
}

void sum_bf16(void *c, const void *a, const void *b, size_t n) {
  uint16_t *o = static_cast<uint16_t *>(c);
  const uint16_t *x = static_cast<const uint16_t *>(a), *y = static_cast<const uint16_t *>(b);
  for (size_t i = 0; i < n; i++)
    o[i] = nmt_half_bf16_bits(nmt_half_bf16_value(x[i]) + nmt_half_bf16_value(y[i]));
}

void encode(nmt_grad_dtype wire, const float *src, uint16_t *dst, size_t n) {
  if (wire == NMT_GRAD_FP16)
    for (size_t i = 0; i < n; i++) dst[i] = nmt_half_fp16_bits(src[i]);
  else
    for (size_t i = 0; i < n; i++) dst[i] = nmt_half_bf16_bits(src[i]);
}

void decode(nmt_grad_dtype wire, const uint16_t *src, float *dst, size_t n) {
  if (wire == NMT_GRAD_FP16)
    for (size_t i = 0; i < n; i++) dst[i] = nmt_half_fp16_value(src[i]);
  else
    for (size_t i = 0; i < n; i++) dst[i] = nmt_half_bf16_value(src[i]);
}

/* ---- running a collective ---- */

nmt_status fail(gloo_rank *me, const char *op, nmt_status st, const std::string &what) {
  gloo_group *g = me->g;
  const bool mate_failed = g->failed.exchange(1) != 0;
  poison(g, me->local);
  const nmt_comm *c = &me->base;
  if (aborted(g))
    return nmt_errorf(NMT_ERR_ABORTED, "gloo %s on rank %d of %d: aborted (nmt_comm_abort or the "
                      "run's abort flag)", op, c->rank, c->size);
  /* Gloo's checks failing inside a collective after a process-mate's collective failed (and
   * closed its connections): the cause is that failure, not this rank. */
  if (st == NMT_ERR_INTERNAL && mate_failed) st = NMT_ERR_ABORTED;
  return nmt_errorf(st, "gloo %s on rank %d of %d: %s (parallel.timeout_s = %g s; a peer process "
                    "died, stalled or aborted)", op, c->rank, c->size, what.c_str(),
                    (double)g->timeout.count() / 1000.0);
}

/* Runs body(group, state) for rank c, turning every exception into a status: no C++ exception
 * leaves this file. */
template <class F> nmt_status run(nmt_comm *c, const char *op, F &&body) {
  gloo_rank *me = reinterpret_cast<gloo_rank *>(c);
  gloo_group *g = me->g;
  if (aborted(g)) return NMT_ERR_ABORTED;
  if (g->st[me->local].poisoned.load())
    return nmt_errorf(NMT_ERR_ABORTED, "gloo %s on rank %d of %d: the group failed earlier (see "
                      "the first error)", op, c->rank, c->size);
  try {
    body(g, g->st[me->local]);
    return NMT_OK;
  } catch (const nmt_gloo::StoreError &e) {
    return fail(me, op, e.status, e.what());
  } catch (const gloo::IoException &e) {
    return fail(me, op, NMT_ERR_ABORTED, e.what());
  } catch (const std::bad_alloc &) {
    return fail(me, op, NMT_ERR_NOMEM, "out of memory");
  } catch (const std::exception &e) {
    return fail(me, op, NMT_ERR_INTERNAL, e.what());
  } catch (...) {
    return fail(me, op, NMT_ERR_INTERNAL, "unknown C++ exception");
  }
}

void allreduce(gloo_group *g, rank_state &s, void *buf, size_t count, size_t elem,
               void (*fn)(void *, const void *, const void *, size_t)) {
  gloo::AllreduceOptions o(s.ctx);
  if (elem == 4)
    o.setOutput(static_cast<float *>(buf), count);
  else
    o.setOutput(static_cast<uint16_t *>(buf), count);
  o.setReduceFunction(fn);
  o.setTimeout(g->timeout);
  gloo::allreduce(o);
}

nmt_status gl_allreduce_sum(nmt_comm *c, float *buf, size_t count) {
  return run(c, "allreduce_sum", [&](gloo_group *g, rank_state &s) {
    if (count && c->size > 1) allreduce(g, s, buf, count, 4, sum_f32);
  });
}

nmt_status gl_allreduce_max(nmt_comm *c, float *buf, size_t count) {
  return run(c, "allreduce_max", [&](gloo_group *g, rank_state &s) {
    if (count && c->size > 1) allreduce(g, s, buf, count, 4, max_f32);
  });
}

/* comm.c sends only fp16/bf16 here, with count <= the reservation (s.wire.size()). */
nmt_status gl_allreduce_sum_as(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire) {
  return run(c, "allreduce_sum_as", [&](gloo_group *g, rank_state &s) {
    if (!count) return;
    encode(wire, buf, s.wire.data(), count);
    if (c->size > 1)
      allreduce(g, s, s.wire.data(), count, 2, wire == NMT_GRAD_FP16 ? sum_fp16 : sum_bf16);
    decode(wire, s.wire.data(), buf, count);
  });
}

nmt_status gl_reserve(nmt_comm *c, size_t max_count) {
  return run(c, "reserve", [&](gloo_group *, rank_state &s) { s.wire.resize(max_count); });
}

/* The reduce-scatter half of gloo::allreduce's ring, over Gloo's unbound buffers (see the file
 * comment for why not Gloo's own reduce-scatter). n - 1 steps: at step k rank r sends its
 * partial sum of chunk (r - 1 - k) mod n to rank r + 1, receives rank r - 1's partial of chunk
 * (r - 2 - k) mod n and adds its own value to it, so chunk r is complete on rank r, in place,
 * after the last step: S_r = x_r (+) (x_{r-1} (+) (... (+) (x_{r+2} (+) x_{r+1}))).
 * data: n x count elements of `elem` bytes. */
void ring_reduce_scatter(gloo_group *g, rank_state &s, const nmt_comm *c, void *data,
                         size_t count, size_t elem,
                         void (*fn)(void *, const void *, const void *, size_t)) {
  const int n = c->size, r = c->rank;
  const size_t bytes = count * elem;
  if (s.tmp.size() < bytes) s.tmp.resize(bytes);
  auto out = s.ctx->createUnboundBuffer(data, bytes * (size_t)n);
  auto in = s.ctx->createUnboundBuffer(s.tmp.data(), bytes);
  const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, 0);
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  for (int k = 0; k < n - 1; k++) {
    const size_t send_chunk = (size_t)((r - 1 - k + 2 * n) % n);
    const size_t recv_chunk = (size_t)((r - 2 - k + 2 * n) % n);
    out->send(right, slot, send_chunk * bytes, bytes);
    in->recv(left, slot, 0, bytes);
    if (!in->waitRecv(g->timeout)) throw gloo::IoException("reduce-scatter receive aborted");
    char *mine = static_cast<char *>(data) + recv_chunk * bytes;
    fn(mine, mine, s.tmp.data(), count);
    if (!out->waitSend(g->timeout)) throw gloo::IoException("reduce-scatter send aborted");
  }
}

nmt_status gl_reduce_scatter_sum_as(nmt_comm *c, float *buf, size_t count, nmt_grad_dtype wire) {
  return run(c, "reduce_scatter_sum_as", [&](gloo_group *g, rank_state &s) {
    if (!count) return;
    const int n = c->size;
    float *mine = buf + (size_t)c->rank * count;
    if (wire == NMT_GRAD_FP32) {
      if (n > 1) ring_reduce_scatter(g, s, c, buf, count, sizeof(float), sum_f32);
      return;
    }
    /* Half wire: the whole buffer through the reserved scratch (n x count, comm.c checks). */
    uint16_t *w = s.wire.data();
    if (n > 1) {
      encode(wire, buf, w, count * (size_t)n);
      ring_reduce_scatter(g, s, c, w, count, sizeof(uint16_t),
                          wire == NMT_GRAD_FP16 ? sum_fp16 : sum_bf16);
    } else {
      encode(wire, mine, w, count);
    }
    decode(wire, w + (size_t)c->rank * count * (n > 1), mine, count);
  });
}

nmt_status gl_all_gather(nmt_comm *c, void *buf, size_t count, nmt_grad_dtype dtype) {
  return run(c, "all_gather", [&](gloo_group *g, rank_state &s) {
    if (!count || c->size == 1) return;
    const size_t bytes = count * (dtype == NMT_GRAD_FP32 ? 4 : 2) * (size_t)c->size;
    gloo::AllgatherOptions o(s.ctx);
    o.setOutput(static_cast<char *>(buf), bytes);
    o.setTimeout(g->timeout);
    gloo::allgather(o);
  });
}

nmt_status gl_broadcast(nmt_comm *c, float *buf, size_t count, int root) {
  return run(c, "broadcast", [&](gloo_group *g, rank_state &s) {
    if (!count || c->size == 1) return;
    gloo::BroadcastOptions o(s.ctx);
    o.setOutput(buf, count);
    o.setRoot(root);
    o.setTimeout(g->timeout);
    gloo::broadcast(o);
  });
}

nmt_status gl_barrier(nmt_comm *c) {
  return run(c, "barrier", [&](gloo_group *g, rank_state &s) {
    if (c->size == 1) return;
    gloo::BarrierOptions o(s.ctx);
    o.setTimeout(g->timeout);
    gloo::barrier(o);
  });
}

/* Collectives are complete when they return; only a failure is left to report. */
nmt_status gl_flush(nmt_comm *c) {
  gloo_rank *me = reinterpret_cast<gloo_rank *>(c);
  return aborted(me->g) || me->g->st[me->local].poisoned.load() ? NMT_ERR_ABORTED : NMT_OK;
}

void gl_abort(nmt_comm *c) {
  gloo_group *g = reinterpret_cast<gloo_rank *>(c)->g;
  g->abort->store(1); /* seq_cst, as the host communicator's */
  poison_all(g);
}

void stop_watcher(gloo_group *g) {
  if (!g->watcher.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(g->watch_mu);
    g->watch_stop = true;
  }
  g->watch_cv.notify_all();
  g->watcher.join();
}

void gl_destroy(nmt_comm **comms, int n) {
  (void)n; /* every handle lives in the one group */
  gloo_group *g = reinterpret_cast<gloo_rank *>(comms[0])->g;
  stop_watcher(g);
  delete g; /* contexts close their pairs, then the device stops its thread */
}

const nmt_comm_ops gloo_ops = {
    .name = "gloo",
    .allreduce_sum = gl_allreduce_sum,
    .allreduce_sum_as = gl_allreduce_sum_as,
    .reserve = gl_reserve,
    .allreduce_max = gl_allreduce_max,
    .reduce_scatter_sum_as = gl_reduce_scatter_sum_as,
    .all_gather = gl_all_gather,
    .broadcast = gl_broadcast,
    .barrier = gl_barrier,
    .reserve_staging = NULL, /* stages nothing */
    .flush = gl_flush,
    .abort = gl_abort,
    .destroy = gl_destroy,
};

/* ---- creating a group ---- */

/* See the file comment: a peer that has gone must be an error, not a killed process. */
void ignore_sigpipe() {
  struct sigaction sa;
  if (sigaction(SIGPIPE, nullptr, &sa) != 0 || (sa.sa_flags & SA_SIGINFO) ||
      sa.sa_handler != SIG_DFL)
    return;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_IGN;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGPIPE, &sa, nullptr);
}

std::string key_prefix(const nmt_gloo_options *o) {
  const std::string p = o->prefix ? o->prefix : "";
  return p.empty() ? "gloo" : p + "/gloo";
}

nmt_status check_args(const nmt_gloo_options *o, int n_local, const int *global_ranks, int world,
                      nmt_comm **comms) {
  if (!o || !global_ranks || !comms)
    return nmt_errorf(NMT_ERR_INTERNAL, "gloo communicator: NULL options, ranks or comms");
  if (o->size < sizeof(nmt_gloo_options))
    return nmt_errorf(NMT_ERR_INTERNAL, "gloo communicator: options.size = %zu, expected %zu "
                      "(set it to sizeof(nmt_gloo_options))", o->size, sizeof(nmt_gloo_options));
  if (!o->rendezvous || !*o->rendezvous)
    return nmt_errorf(NMT_ERR_CONFIG, "parallel.rendezvous: empty path (a directory every node "
                      "can read and write)");
  if (!(o->timeout_s > 0))
    return nmt_errorf(NMT_ERR_CONFIG, "parallel.timeout_s = %g: must be > 0 (seconds)",
                      o->timeout_s);
  if (world < 1 || n_local < 1 || n_local > world)
    return nmt_errorf(NMT_ERR_INTERNAL, "gloo communicator: %d local ranks of a world of %d "
                      "(need 1 <= local <= world)", n_local, world);
  for (int i = 0; i < n_local; i++) {
    if (global_ranks[i] < 0 || global_ranks[i] >= world)
      return nmt_errorf(NMT_ERR_INTERNAL, "gloo communicator: local rank %d has global rank %d, "
                        "not in [0, %d)", i, global_ranks[i], world);
    for (int j = 0; j < i; j++)
      if (global_ranks[j] == global_ranks[i])
        return nmt_errorf(NMT_ERR_INTERNAL, "gloo communicator: global rank %d given twice",
                          global_ranks[i]);
  }
  return NMT_OK;
}

/* Throws unless interface `name` exists with an IPv4 or IPv6 address; the message lists the
 * interfaces that have one. Checked here because Gloo's own lookup names only the interface,
 * and leaks getifaddrs' list when it fails. */
void check_iface(const std::string &name) {
  struct ifaddrs *all = nullptr;
  if (getifaddrs(&all) != 0) throw std::runtime_error(std::string("getifaddrs: ") + strerror(errno));
  bool found = false;
  std::string names;
  for (struct ifaddrs *a = all; a; a = a->ifa_next) {
    if (!a->ifa_addr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6))
      continue;
    found = found || name == a->ifa_name;
    if (names.find(std::string(" ") + a->ifa_name + ",") == std::string::npos)
      names += std::string(" ") + a->ifa_name + ",";
  }
  freeifaddrs(all);
  if (!found) {
    if (!names.empty()) names.pop_back();
    throw std::runtime_error("no interface of that name with an IP address (this machine's:" +
                             names + ")");
  }
}

/* The TCP device: on the interface if one is named, else on the host name or address given,
 * else on this machine's name (what its peers on other nodes resolve). */
std::shared_ptr<gloo::transport::Device> make_device(const nmt_gloo_options *o,
                                                     std::string *where) {
  gloo::transport::tcp::attr attr;
  if (o->iface && *o->iface) {
    attr.iface = o->iface;
    *where = "interface '" + attr.iface + "'";
    check_iface(attr.iface);
  } else {
    if (o->hostname && *o->hostname) {
      attr.hostname = o->hostname;
    } else {
      char name[256] = "";
      if (gethostname(name, sizeof name - 1) != 0)
        throw std::runtime_error(std::string("gethostname: ") + strerror(errno));
      attr.hostname = name;
    }
    *where = "host '" + attr.hostname + "'";
  }
  return gloo::transport::tcp::CreateDevice(attr);
}

struct connect_result {
  nmt_status st = NMT_OK;
  std::string msg;
  std::string key; /* the store key that was missing, for a store timeout */
};

/* One local rank's connectFullMesh, on its own thread (each waits for the others' keys). */
void connect_one(const nmt_gloo_options *o, gloo_group *g, gloo::rendezvous::Context *ctx,
                 const std::atomic<int> *stop, connect_result *res) {
  try {
    nmt_gloo::Store store(o->rendezvous, key_prefix(o), g->timeout, stop);
    store.fix_deadline();
    ctx->connectFullMesh(store, g->dev);
    return;
  } catch (const nmt_gloo::StoreError &e) {
    res->st = e.status;
    res->msg = e.what();
    res->key = e.key;
  } catch (const gloo::IoException &e) {
    res->st = NMT_ERR_ABORTED;
    res->msg = e.what();
  } catch (const std::bad_alloc &) {
    res->st = NMT_ERR_NOMEM;
    res->msg = "out of memory";
  } catch (const std::exception &e) {
    res->st = NMT_ERR_INTERNAL;
    res->msg = e.what();
  } catch (...) {
    res->st = NMT_ERR_INTERNAL;
    res->msg = "unknown C++ exception";
  }
  if (res->msg.empty()) res->msg = "failed";
}

/* The error of a failed connect, on the calling thread. A store timeout names every rank
 * whose key is still missing (the ranks are the keys), not just the first one waited for. */
nmt_status connect_error(const nmt_gloo_options *o, gloo_group *g, int world,
                         const int *global_ranks, const std::vector<connect_result> &res) {
  const connect_result *first = nullptr;
  int who = 0;
  for (size_t i = 0; i < res.size(); i++)
    if (res[i].st != NMT_OK && (!first || (first->key.empty() && !res[i].key.empty()))) {
      first = &res[i];
      who = (int)i;
    }
  if (!first) return nmt_errorf(NMT_ERR_INTERNAL, "gloo communicator: could not start threads");
  if (first->st == NMT_ERR_ABORTED && !first->key.empty() && !aborted(g)) {
    std::string missing;
    try {
      nmt_gloo::Store store(o->rendezvous, key_prefix(o), g->timeout, nullptr);
      for (int r = 0; r < world; r++)
        if (!store.has(std::to_string(r))) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    } catch (...) {
      missing.clear();
    }
    if (!missing.empty())
      return nmt_errorf(NMT_ERR_ABORTED, "gloo: rank(s) %s of %d did not arrive within %g s "
                        "(parallel.timeout_s): their processes have not started, failed, or use "
                        "another rendezvous. %s", missing.c_str(), world,
                        (double)g->timeout.count() / 1000.0, first->msg.c_str());
  }
  return nmt_errorf(first->st, "gloo: connecting rank %d of %d: %s", global_ranks[who], world,
                    first->msg.c_str());
}

/* Connects every local rank's context; on success they are in g->st[i].ctx. */
nmt_status connect_all(const nmt_gloo_options *o, gloo_group *g, const int *global_ranks,
                       int world, atomic_int *abort) {
  const int n = g->n_local;
  std::vector<std::shared_ptr<gloo::rendezvous::Context>> ctx((size_t)n);
  std::vector<connect_result> res((size_t)n);
  std::atomic<int> stop{0}, done{0};
  std::vector<std::thread> th;
  try {
    for (int i = 0; i < n; i++) {
      ctx[(size_t)i] = std::make_shared<gloo::rendezvous::Context>(global_ranks[i], world);
      ctx[(size_t)i]->setTimeout(g->timeout);
    }
    for (int i = 0; i < n; i++)
      th.emplace_back([&, i] {
        connect_one(o, g, ctx[(size_t)i].get(), &stop, &res[(size_t)i]);
        done.fetch_add(1);
      });
  } catch (const std::exception &e) {
    stop.store(1); /* the started ones would wait for the missing ranks' keys */
    for (auto &t : th) t.join();
    return nmt_errorf(NMT_ERR_NOMEM, "gloo communicator: cannot start %d connect threads: %s", n,
                      e.what());
  }
  /* A stop signal during the rendezvous (the run's abort flag) ends the store waits. */
  while (done.load() < n) {
    if (abort && abort->load(std::memory_order_relaxed)) stop.store(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto &t : th) t.join();
  bool ok = true;
  for (int i = 0; i < n; i++) {
    if (res[(size_t)i].st != NMT_OK) {
      ok = false;
      continue;
    }
    g->st[i].ctx = ctx[(size_t)i];
    g->st[i].connected.store(true);
  }
  if (ok) return NMT_OK;
  poison_all(g); /* peers already connected to a local rank fail now, not at their timeout */
  if (stop.load() && abort && abort->load())
    return nmt_errorf(NMT_ERR_ABORTED, "gloo: aborted while connecting (the run's abort flag)");
  return connect_error(o, g, world, global_ranks, res);
}

} // namespace

extern "C" nmt_status nmt_comm_create_gloo(const nmt_gloo_options *o, int n_local,
                                           const int *global_ranks, int world, atomic_int *abort,
                                           nmt_comm **comms) {
  NMT_TRY(check_args(o, n_local, global_ranks, world, comms));
  ignore_sigpipe();
  std::unique_ptr<gloo_group> g(new (std::nothrow) gloo_group);
  if (!g) return nmt_errorf(NMT_ERR_NOMEM, "gloo communicator: out of memory");
  g->abort = abort ? abort : &g->own_abort;
  g->n_local = n_local;
  g->timeout = nmt_gloo::ms_of(o->timeout_s);
  std::string where;
  try {
    g->st.reset(new rank_state[(size_t)n_local]);
    g->ranks.reset(new gloo_rank[(size_t)n_local]);
    g->dev = make_device(o, &where);
  } catch (const std::bad_alloc &) {
    return nmt_errorf(NMT_ERR_NOMEM, "gloo communicator: out of memory");
  } catch (const std::exception &e) {
    return nmt_errorf(NMT_ERR_CONFIG, "gloo: cannot open a TCP device on %s: %s", where.c_str(),
                      e.what());
  }
  NMT_TRY(connect_all(o, g.get(), global_ranks, world, abort));
  if (abort) {
    try {
      g->watcher = std::thread(watch_abort, g.get());
    } catch (const std::exception &e) {
      return nmt_errorf(NMT_ERR_NOMEM, "gloo communicator: cannot start the abort watcher: %s",
                        e.what());
    }
  }
  for (int i = 0; i < n_local; i++) {
    gloo_rank &r = g->ranks[i];
    r.base.ops = &gloo_ops;
    r.base.rank = global_ranks[i];
    r.base.size = world;
    r.base.wire_reserved = 0;
    r.base.staging_reserved = 0;
    r.g = g.get();
    r.local = i;
    comms[i] = &r.base;
  }
  g.release();
  return NMT_OK;
}
