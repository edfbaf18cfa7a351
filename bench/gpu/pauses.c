/* When the machine stops a CPU (issue 33, item 3): one thread per CPU,
 * pinned, spins on CLOCK_MONOTONIC for SECONDS and records every gap over
 * THRESHOLD_US between two reads: time the thread did not run (a guest
 * interrupt, or the hypervisor holding the virtual CPU, which the guest's
 * /proc/interrupts does not show). No GPU, no library: what any call that
 * long meets on this machine. Prints per CPU the pauses per second, their
 * length (p50, p99, max), the most common intervals between them (a timer
 * shows as one interval, e.g. 1.0 ms), and how many of each CPU's pauses
 * had one on the first CPU within 5 us (the whole machine stopping at
 * once).
 *
 *   gcc -O2 -pthread bench/gpu/pauses.c -o /tmp/pauses && /tmp/pauses 2 3 [CPUS [FILE]]
 *
 * CPUS: which CPUs, "A-B" or "A" (default: all online). FILE: every pause
 * of the first CPU's thread as "START_US LENGTH_US" lines (CLOCK_MONOTONIC,
 * the clock stalls_cuda.c stamps its calls with), to tell which of a
 * benchmark's slow calls met one (bench/gpu/stalls_slow.py). SIGTERM or
 * SIGINT ends the spinning early (the report and FILE still come out), so
 * a script can run it beside a benchmark of unknown length. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { MAX_PAUSES = 200000 };

static volatile sig_atomic_t stop;
static void on_signal(int sig) { (void)sig; stop = 1; }

struct spinner {
  int cpu;
  double seconds, threshold_us;
  int n;
  double* at;  /* pause start, us on CLOCK_MONOTONIC */
  double* len; /* pause length, us */
};

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static void* spin(void* arg) {
  struct spinner* s = arg;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(s->cpu, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
    s->n = -1;
    return NULL;
  }
  double start = now_us(), prev = start, end = start + s->seconds * 1e6;
  while (prev < end && !stop) {
    double t = now_us();
    if (t - prev > s->threshold_us && s->n < MAX_PAUSES) {
      s->at[s->n] = prev;
      s->len[s->n] = t - prev;
      s->n++;
    }
    prev = t;
  }
  return NULL;
}

/* The three most common intervals between consecutive pauses, 0.1 ms bins. */
static void intervals(const struct spinner* s, char* out, size_t cap) {
  enum { BINS = 200 };
  int count[BINS] = {0};
  for (int i = 1; i < s->n; i++) {
    int b = (int)((s->at[i] - s->at[i - 1]) / 100 + 0.5);
    if (b < BINS) count[b]++;
  }
  out[0] = 0;
  for (int k = 0; k < 3; k++) {
    int best = 0;
    for (int b = 1; b < BINS; b++)
      if (count[b] > count[best]) best = b;
    if (count[best] == 0) break;
    size_t used = strlen(out);
    snprintf(out + used, cap - used, "%s%.1f ms x%d", k ? ", " : "", best / 10.0, count[best]);
    count[best] = 0;
  }
}

int main(int argc, char** argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 2;
  double threshold = argc > 2 ? atof(argv[2]) : 3;
  int first = 0, last = (int)sysconf(_SC_NPROCESSORS_ONLN) - 1;
  if (argc > 3 && sscanf(argv[3], "%d-%d", &first, &last) == 1) last = first;
  int ncpu = last - first + 1;
  const char* dump = argc > 4 ? argv[4] : NULL;
  if (seconds <= 0 || seconds > 600 || threshold <= 0 || first < 0 || ncpu < 1 || ncpu > 1024) {
    fprintf(stderr, "usage: pauses SECONDS(<=600) THRESHOLD_US [CPUS(A-B) [FILE]]\n");
    return 2;
  }
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);
  double began = now_us();
  struct spinner* s = calloc(ncpu, sizeof *s);
  pthread_t* th = calloc(ncpu, sizeof *th);
  for (int c = 0; c < ncpu; c++) {
    s[c] = (struct spinner){first + c, seconds, threshold, 0, malloc(MAX_PAUSES * sizeof(double)),
                            malloc(MAX_PAUSES * sizeof(double))};
    pthread_create(&th[c], NULL, spin, &s[c]);
  }
  for (int c = 0; c < ncpu; c++) pthread_join(th[c], NULL);
  seconds = (now_us() - began) / 1e6; /* less when stopped early */
  printf("pauses over %.1f us, %.1f s spinning on each of %d CPUs\n", threshold, seconds, ncpu);
  FILE* f = dump ? fopen(dump, "w") : NULL;
  for (int i = 0; f && s[0].n > 0 && i < s[0].n; i++)
    fprintf(f, "%.1f %.1f\n", s[0].at[i], s[0].len[i]);
  if (f) fclose(f);
  double* sorted = malloc(MAX_PAUSES * sizeof(double));
  for (int c = 0; c < ncpu; c++) {
    if (s[c].n < 0) {
      printf("cpu %d: could not pin\n", s[c].cpu);
      continue;
    }
    if (s[c].n == 0) {
      printf("cpu %d: none\n", s[c].cpu);
      continue;
    }
    memcpy(sorted, s[c].len, s[c].n * sizeof(double));
    qsort(sorted, s[c].n, sizeof(double), cmp_double);
    double busy = 0;
    for (int i = 0; i < s[c].n; i++) busy += s[c].len[i];
    char iv[128];
    intervals(&s[c], iv, sizeof iv);
    /* Of this CPU's pauses, how many had one on the first CPU within 5 us. */
    int with0 = 0, j = 0;
    for (int i = 0; c > 0 && s[0].n > 0 && i < s[c].n; i++) {
      while (j < s[0].n - 1 && s[0].at[j] < s[c].at[i] - 5) j++;
      if (s[0].at[j] >= s[c].at[i] - 5 && s[0].at[j] <= s[c].at[i] + 5) with0++;
    }
    printf("cpu %d: %.0f/s, %.2f%% of the time; length p50 %.1f p99 %.1f max %.1f us; "
           "intervals %s; with cpu %d %d\n",
           s[c].cpu, s[c].n / seconds, busy / (seconds * 1e4), sorted[s[c].n / 2],
           sorted[(s[c].n * 99) / 100], sorted[s[c].n - 1], iv, first, with0);
  }
  return 0;
}
