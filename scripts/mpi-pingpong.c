/* A two-rank MPI ping-pong of SIZE bytes, ITERS round trips after 100 of warm-up: what
 * scripts/mpi-instructions-guest runs under callgrind (rank 0) to count the user-space
 * instructions one MPI round trip costs over each stack (Open MPI's cm/ofi over rverbs or
 * verbs;ofi_rxm, its ucx pml). Checks every reply's bytes, so a stack that loses or
 * corrupts a message fails the run. Under callgrind with --collect-atstart=no, only the
 * round trips after the warm-up are counted (valgrind's client requests, no-ops
 * otherwise): MPI_Init's work, and the spinning while the first message's connection is
 * made, vary from run to run by more than many round trips'. With MPI_SETTLE_US set, rank
 * 0 sleeps that long between its send and its receive, outside the count, so the reply is
 * there at its first poll: the count holds no spins, whose number follows how fast the
 * other rank answers (two runs' spins differed by more than 600 round trips' worth).
 *
 *   mpi-pingpong SIZE ITERS */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <valgrind/callgrind.h>

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc != 3 || n != 2) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np 2 mpi-pingpong SIZE ITERS\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int size = atoi(argv[1]), iters = atoi(argv[2]);
    const char *settle = getenv("MPI_SETTLE_US");
    useconds_t settle_us = settle ? (useconds_t)atoi(settle) : 0;
    char *buf = malloc(size ? size : 1), *want = malloc(size ? size : 1);
    for (int i = -100; i < iters; i++) {
        if (i == 0)
            CALLGRIND_TOGGLE_COLLECT;
        if (rank == 0) {
            memset(buf, (char)i, size);
            MPI_Send(buf, size, MPI_CHAR, 1, 7, MPI_COMM_WORLD);
            if (settle_us && i >= 0) {
                CALLGRIND_TOGGLE_COLLECT;
                usleep(settle_us);
                CALLGRIND_TOGGLE_COLLECT;
            }
            MPI_Recv(buf, size, MPI_CHAR, 1, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            memset(want, (char)(i + 1), size);
            if (memcmp(buf, want, size) != 0) {
                fprintf(stderr, "mpi-pingpong: round %d came back wrong\n", i);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        } else {
            MPI_Recv(buf, size, MPI_CHAR, 0, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            for (int k = 0; k < size; k++)
                buf[k]++;
            MPI_Send(buf, size, MPI_CHAR, 0, 7, MPI_COMM_WORLD);
        }
    }
    CALLGRIND_TOGGLE_COLLECT;
    if (rank == 0)
        printf("mpi-pingpong: ok, %d round trips of %d bytes\n", iters, size);
    free(buf);
    free(want);
    MPI_Finalize();
    return 0;
}
