/* nmt/clock.h — the host's monotonic clock in seconds, for durations: step times, tokens/s,
 * ETAs, the warm-up's length. CLOCK_MONOTONIC, so a wall-clock change (NTP, a user setting the
 * date) never makes a step take negative or hours-long time. Timestamps meant for people
 * (status.json's updated_unix) use the real-time clock instead.
 *
 * defines: nmt_clock_now_s
 */
#ifndef NMT_CLOCK_H
#define NMT_CLOCK_H

#ifdef __cplusplus
extern "C" {
#endif

/* Seconds of CLOCK_MONOTONIC (an arbitrary origin: only differences mean anything), with the
 * clock's resolution (ns on Linux). Cannot fail. */
double nmt_clock_now_s(void);

#ifdef __cplusplus
}
#endif
#endif /* NMT_CLOCK_H */
