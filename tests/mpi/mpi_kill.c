/* A rank killed mid-job: rank 1 of a ring exchange SIGKILLs itself after 50 rounds while
 * the others wait on it. The job must end (Open MPI reports the dead rank and aborts the
 * survivors) rather than hang: scripts/mpi checks that mpirun fails, names the signal, and
 * returns well within its timeout. */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	int rank, size, v = 0;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	for (int i = 0; i < 1000000; i++) {
		if (rank == 1 && i == 50) {
			fprintf(stderr, "mpi_kill: rank 1 kills itself at round %d\n", i);
			kill(getpid(), SIGKILL);
		}
		MPI_Sendrecv_replace(&v, 1, MPI_INT, (rank + 1) % size, 0, (rank + size - 1) % size,
				     0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	}
	printf("mpi_kill: rank %d finished, which it should not\n", rank);
	MPI_Finalize();
	return 0;
}
