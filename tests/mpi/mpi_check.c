/* What MPI programs do, checked byte by byte over whatever provider the job selected:
 * messages across every rverbs protocol boundary between every pair of ranks, many
 * outstanding requests, an unexpected-message flood, probes with wildcards, synchronous
 * sends, a cancelled receive, and collectives. Rank 0 prints "mpi_check: ok, N checks"; any
 * failure aborts the job with the reason. Built and run by scripts/mpi. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size;
static long checks;

#define CHECK(cond, ...)                                                                    \
	do {                                                                                \
		checks++;                                                                   \
		if (!(cond)) {                                                              \
			fprintf(stderr, "mpi_check: rank %d: %s:%d: ", rank, __FILE__,      \
				__LINE__);                                                  \
			fprintf(stderr, __VA_ARGS__);                                       \
			fprintf(stderr, "\n");                                              \
			MPI_Abort(MPI_COMM_WORLD, 1);                                       \
		}                                                                           \
	} while (0)

static uint8_t byte_of(int from, int to, size_t i, size_t n)
{
	return (uint8_t)(i * 31 + from * 7 + to * 13 + n);
}

static void fill(uint8_t *b, int from, int to, size_t n)
{
	for (size_t i = 0; i < n; i++)
		b[i] = byte_of(from, to, i, n);
}

static size_t first_bad(const uint8_t *b, int from, int to, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (b[i] != byte_of(from, to, i, n))
			return i;
	return n;
}

/* Every pair of ranks, both ways, at sizes around each protocol boundary (inline, eager
 * 16352 B or a whole 16 KiB buffer without a header, segmented up to 64 KiB, rendezvous,
 * and past one RDMA read of rxe's 8 MiB: read in pieces; 8 KiB buffers' 8160 and 8192
 * too), with all requests outstanding at once. */
static void all_pairs(void)
{
	static const size_t sizes[] = {0,     1,     8,     4096,    8160,    8192,
				       16352, 16353, 16384, 16385,   65536,   65537,
				       1 << 20, 4 << 20,
				       (8 << 20) + 3};
	for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
		size_t n = sizes[s];
		uint8_t **out = calloc(size, sizeof *out), **in = calloc(size, sizeof *in);
		MPI_Request *req = calloc(2 * size, sizeof *req);
		int k = 0;
		for (int p = 0; p < size; p++) {
			out[p] = malloc(n + 1);
			in[p] = calloc(1, n + 1);
			fill(out[p], rank, p, n);
			MPI_Irecv(in[p], (int)n, MPI_BYTE, p, 100 + (int)s, MPI_COMM_WORLD, &req[k++]);
		}
		for (int p = 0; p < size; p++)
			MPI_Isend(out[p], (int)n, MPI_BYTE, p, 100 + (int)s, MPI_COMM_WORLD, &req[k++]);
		MPI_Waitall(k, req, MPI_STATUSES_IGNORE);
		for (int p = 0; p < size; p++) {
			size_t bad = first_bad(in[p], p, rank, n);
			CHECK(bad == n, "%zu bytes from rank %d differ at byte %zu", n, p, bad);
			free(out[p]);
			free(in[p]);
		}
		free(out);
		free(in);
		free(req);
	}
}

/* 256 small messages to the next rank before it posts a receive (unexpected at the
 * receiver), then taken in order: MPI's non-overtaking rule. */
static void unexpected_flood(void)
{
	enum { N = 256, LEN = 1000 };
	int next = (rank + 1) % size, prev = (rank + size - 1) % size;
	uint8_t *out = malloc(N * LEN), *in = malloc(LEN);
	MPI_Request *req = malloc(N * sizeof *req);
	for (int i = 0; i < N; i++) {
		fill(out + i * LEN, rank, i, LEN);
		MPI_Isend(out + i * LEN, LEN, MPI_BYTE, next, 7, MPI_COMM_WORLD, &req[i]);
	}
	MPI_Barrier(MPI_COMM_WORLD);
	for (int i = 0; i < N; i++) {
		MPI_Recv(in, LEN, MPI_BYTE, prev, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		CHECK(first_bad(in, prev, i, LEN) == LEN, "flood message %d from %d out of order", i,
		      prev);
	}
	MPI_Waitall(N, req, MPI_STATUSES_IGNORE);
	free(out);
	free(in);
	free(req);
}

/* Rank 0 probes with wildcards for one message from every other rank (sizes differ). */
static void probes(void)
{
	if (rank != 0) {
		int n = 100 + rank;
		uint8_t *b = malloc(n);
		fill(b, rank, 0, n);
		MPI_Send(b, n, MPI_BYTE, 0, 50, MPI_COMM_WORLD);
		MPI_Send(b, n, MPI_BYTE, 0, 60, MPI_COMM_WORLD);
		free(b);
		/* Later messages to rank 0 wait until its wildcard probes are done. */
		MPI_Barrier(MPI_COMM_WORLD);
		return;
	}
	int seen = 0;
	for (int i = 1; i < size; i++) {
		MPI_Status st;
		int n;
		/* Any source, one tag: a sender's later message (tag 60) must not be seen first. */
		MPI_Probe(MPI_ANY_SOURCE, 50, MPI_COMM_WORLD, &st);
		MPI_Get_count(&st, MPI_BYTE, &n);
		CHECK(st.MPI_TAG == 50 && n == 100 + st.MPI_SOURCE,
		      "probe: source %d tag %d count %d", st.MPI_SOURCE, st.MPI_TAG, n);
		uint8_t *b = malloc(n);
		MPI_Recv(b, n, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		CHECK(first_bad(b, st.MPI_SOURCE, 0, n) == (size_t)n, "probed message differs");
		seen |= 1 << st.MPI_SOURCE;
		free(b);
	}
	CHECK(seen == ((1 << size) - 2), "probes saw ranks %#x", seen);
	for (int i = 1; i < size; i++) {
		MPI_Message m;
		MPI_Status st;
		int n;
		MPI_Mprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &m, &st);
		CHECK(st.MPI_TAG == 60, "mprobe tag %d", st.MPI_TAG);
		MPI_Get_count(&st, MPI_BYTE, &n);
		uint8_t *b = malloc(n);
		MPI_Mrecv(b, n, MPI_BYTE, &m, MPI_STATUS_IGNORE);
		CHECK(n == 100 + st.MPI_SOURCE && first_bad(b, st.MPI_SOURCE, 0, n) == (size_t)n,
		      "mprobe from %d", st.MPI_SOURCE);
		free(b);
	}
	MPI_Barrier(MPI_COMM_WORLD);
}

/* A synchronous send completes only once matched; a receive nobody sends to is cancelled. */
static void ssend_and_cancel(void)
{
	int next = (rank + 1) % size, prev = (rank + size - 1) % size;
	int v = rank, got = -1, flag = 0;
	MPI_Request r;
	MPI_Status st;
	MPI_Irecv(&got, 1, MPI_INT, prev, 9, MPI_COMM_WORLD, &r);
	MPI_Ssend(&v, 1, MPI_INT, next, 9, MPI_COMM_WORLD);
	MPI_Wait(&r, MPI_STATUS_IGNORE);
	CHECK(got == prev, "ssend carried %d, expected %d", got, prev);
	MPI_Irecv(&got, 1, MPI_INT, MPI_ANY_SOURCE, 999, MPI_COMM_WORLD, &r);
	MPI_Cancel(&r);
	MPI_Wait(&r, &st);
	MPI_Test_cancelled(&st, &flag);
	CHECK(flag, "the unmatched receive was not cancelled");
}

static void collectives(void)
{
	size_t n = 1 << 20;
	uint8_t *b = malloc(n);
	if (rank == 0)
		fill(b, 0, 99, n);
	MPI_Bcast(b, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD);
	CHECK(first_bad(b, 0, 99, n) == n, "bcast differs");
	long x = rank + 1, sum = 0;
	MPI_Allreduce(&x, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
	CHECK(sum == (long)size * (size + 1) / 2, "allreduce %ld", sum);
	int *out = malloc(size * 1024 * sizeof(int)), *in = malloc(size * 1024 * sizeof(int));
	for (int p = 0; p < size; p++)
		for (int i = 0; i < 1024; i++)
			out[p * 1024 + i] = rank * 100000 + p * 1024 + i;
	MPI_Alltoall(out, 1024, MPI_INT, in, 1024, MPI_INT, MPI_COMM_WORLD);
	for (int p = 0; p < size; p++)
		for (int i = 0; i < 1024; i++)
			CHECK(in[p * 1024 + i] == p * 100000 + rank * 1024 + i, "alltoall from %d", p);
	MPI_Barrier(MPI_COMM_WORLD);
	free(b);
	free(out);
	free(in);
}

int main(int argc, char **argv)
{
	int rounds = argc > 1 ? atoi(argv[1]) : 1;
	char host[MPI_MAX_PROCESSOR_NAME];
	int len;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	MPI_Get_processor_name(host, &len);
	fprintf(stderr, "mpi_check: rank %d of %d on %s\n", rank, size, host);
	for (int r = 0; r < rounds; r++) {
		all_pairs();
		unexpected_flood();
		probes();
		ssend_and_cancel();
		collectives();
	}
	long total = 0;
	MPI_Reduce(&checks, &total, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
	if (rank == 0)
		printf("mpi_check: ok, %ld checks on %d ranks\n", total, size);
	MPI_Finalize();
	return 0;
}
