/* One-sided MPI over rverbs (Open MPI's osc rdma on btl ofi, which takes rverbs' RDMA and
 * atomics): puts and gets in fence epochs, accumulates, and passive-target atomics
 * (MPI_Fetch_and_op, MPI_Compare_and_swap) from every rank on one word, results checked.
 * Prints "mpi_rma: ok, N checks on P ranks" or the first failure, and exits 1. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define N 1024
#define ADDS 50

static long checks;

#define CHECK(cond, ...)                                                                   \
	do {                                                                               \
		checks++;                                                                  \
		if (!(cond)) {                                                             \
			fprintf(stderr, "mpi_rma: rank %d: ", rank);                       \
			fprintf(stderr, __VA_ARGS__);                                      \
			fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);                 \
			MPI_Abort(MPI_COMM_WORLD, 1);                                      \
		}                                                                          \
	} while (0)

int main(int argc, char **argv)
{
	int rank, size;
	long *base;
	MPI_Win win;

	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	/* [0, N): put target; [N, 2N): get source; 2N: counter; 2N+1: CAS slot;
	 * [2N+2, 2N+2+N): accumulate target. */
	MPI_Win_allocate((MPI_Aint)(3 * N + 2) * sizeof(long), sizeof(long), MPI_INFO_NULL,
			 MPI_COMM_WORLD, &base, &win);
	for (int i = 0; i < 3 * N + 2; i++)
		base[i] = 0;
	for (int i = 0; i < N; i++)
		base[N + i] = 1000L * rank + i;
	base[2 * N + 1] = -1;
	int right = (rank + 1) % size, left = (rank + size - 1) % size;
	long *buf = malloc(N * sizeof(long));

	/* Fence epochs: put to the right, get from the left. */
	MPI_Win_fence(0, win);
	for (int i = 0; i < N; i++)
		buf[i] = 7L * rank + i;
	MPI_Put(buf, N, MPI_LONG, right, 0, N, MPI_LONG, win);
	MPI_Win_fence(0, win);
	for (int i = 0; i < N; i++)
		CHECK(base[i] == 7L * left + i, "put: base[%d] = %ld", i, base[i]);
	MPI_Get(buf, N, MPI_LONG, left, N, N, MPI_LONG, win);
	MPI_Win_fence(0, win);
	for (int i = 0; i < N; i++)
		CHECK(buf[i] == 1000L * left + i, "get: buf[%d] = %ld", i, buf[i]);

	/* Accumulate (sum) into rank 0 from everyone. */
	for (int i = 0; i < N; i++)
		buf[i] = rank + 1;
	MPI_Accumulate(buf, N, MPI_LONG, 0, 2 * N + 2, N, MPI_LONG, MPI_SUM, win);
	MPI_Win_fence(0, win);
	if (rank == 0)
		for (int i = 0; i < N; i++)
			CHECK(base[2 * N + 2 + i] == (long)size * (size + 1) / 2,
			      "accumulate: %ld", base[2 * N + 2 + i]);
	MPI_Win_fence(0, win);

	/* Passive target: fetch-and-add on rank 0's counter from every rank, and one
	 * compare-and-swap winner. */
	long got[ADDS], one = 1, mine = rank, minus = -1, was = 0;
	MPI_Win_lock_all(0, win);
	for (int k = 0; k < ADDS; k++) {
		MPI_Fetch_and_op(&one, &got[k], MPI_LONG, 0, 2 * N, MPI_SUM, win);
		MPI_Win_flush(0, win);
	}
	MPI_Compare_and_swap(&mine, &minus, &was, MPI_LONG, 0, 2 * N + 1, win);
	MPI_Win_flush(0, win);
	MPI_Win_unlock_all(win);
	MPI_Barrier(MPI_COMM_WORLD);
	long *all = rank == 0 ? malloc((size_t)size * ADDS * sizeof(long)) : NULL;
	MPI_Gather(got, ADDS, MPI_LONG, all, ADDS, MPI_LONG, 0, MPI_COMM_WORLD);
	int won = was == -1, winners = 0;
	MPI_Reduce(&won, &winners, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
	if (rank == 0) {
		MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
		MPI_Win_unlock(0, win);
		CHECK(base[2 * N] == (long)size * ADDS, "counter = %ld", base[2 * N]);
		char *seen = calloc((size_t)size * ADDS, 1);
		for (int i = 0; i < size * ADDS; i++) {
			CHECK(all[i] >= 0 && all[i] < size * ADDS && !seen[all[i]],
			      "fetch %d saw %ld twice or out of range", i, all[i]);
			seen[all[i]] = 1;
		}
		CHECK(winners == 1, "%d compare-and-swap winners", winners);
		CHECK(base[2 * N + 1] >= 0 && base[2 * N + 1] < size, "slot = %ld",
		      base[2 * N + 1]);
		free(seen);
		free(all);
	}
	long total = 0;
	MPI_Reduce(&checks, &total, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
	if (rank == 0)
		printf("mpi_rma: ok, %ld checks on %d ranks\n", total, size);
	free(buf);
	MPI_Win_free(&win);
	MPI_Finalize();
	return 0;
}
