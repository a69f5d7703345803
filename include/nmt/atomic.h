/* nmt/atomic.h — atomic_int in C and in the .cu / .cc files (C++), so that C and C++ code share
 * one flag (the run's abort flag, watched by communicators, the rendezvous store and the CUDA
 * context). In C it is C11's atomic_int; in C++ it is std::atomic<int>, brought into the global
 * namespace as C++23's <stdatomic.h> does. GCC and Clang give both the same representation.
 *
 * defines: atomic_int (C++: using std::atomic_int)
 */
#ifndef NMT_ATOMIC_H
#define NMT_ATOMIC_H

#ifdef __cplusplus
#include <atomic>
using std::atomic_int;
#else
#include <stdatomic.h>
#endif

#endif /* NMT_ATOMIC_H */
