/* callgrind client requests for Python (ctypes): start counting, dump the counts so far under a name, stop.
   Build: gcc -O2 -shared -fPIC -o libcgctl.so cgctl.c (valgrind's headers) */
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
