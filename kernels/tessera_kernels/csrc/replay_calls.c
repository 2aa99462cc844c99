/* The calls of a recording (replay.py) made again in one loop, without Python between them.
 *
 * Every kernel here takes pointers, 64- and 32-bit integers and floats. On x86-64 (System V)
 * the integer-class arguments go, in order, to six registers and then to 8-byte stack slots,
 * and the float arguments, in order, to xmm0..xmm7, whatever their positions among the
 * others. So one prototype (for functions that are not variadic) with MAX_INTS integers and MAX_FLOATS floats calls any of them: the
 * callee reads the ones it declares (32-bit integers from the low half of their slot) and the
 * caller pops the rest. replay.py only builds a plan on x86-64 Linux and for functions whose
 * ctypes argtypes are all of those kinds; everywhere else it replays from Python.
 */
#include <stdint.h>

#if !defined(__x86_64__) || defined(__ILP32__)
#error "one prototype for every kernel holds for x86-64 System V (LP64) only"
#endif

#define MAX_INTS 20
#define MAX_FLOATS 8

typedef struct {
    void *fn;
    int64_t ints[MAX_INTS];
    float floats[MAX_FLOATS];
    int32_t expect;   /* what a function returning int returned when recorded */
    int32_t check;    /* 1: it returns int, and the result is compared */
} call;

typedef int64_t (*any_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, float, float, float, float, float, float, float);

int replay_calls_max_ints(void) { return MAX_INTS; }
int replay_calls_max_floats(void) { return MAX_FLOATS; }

/* Makes calls[0..n) in order; returns -1, or the index of the first call that returned other
 * than recorded (the calls after it are not made), its result in *got. */
int64_t replay_calls(const call *calls, int64_t n, int32_t *got) {
    for (int64_t i = 0; i < n; i++) {
        const call *c = calls + i;
        const int64_t *a = c->ints;
        const float *f = c->floats;
        const int32_t r = (int32_t)((any_fn)c->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                                                    a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19],
                                                    f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]);
        if (c->check && r != c->expect) {
            *got = r;
            return i;
        }
    }
    return -1;
}
