/* The MPI floor: a bare loop of one MPI collective, the fastest any binding can be.
 *
 * Built as a shared library with the MPI compiler wrapper mpi4py's MPI came with
 * (`make bench` does it; benchmarks/bench.py builds it itself when run by hand)
 * and loaded by benchmarks/bench.py with ctypes, so it runs in the same processes,
 * on the same MPI library, at the same thread level (MPI_THREAD_MULTIPLE, as
 * mpi4py initializes it) as every other implementation in the benchmark.
 *
 *   int mpi_floor_run(int op, int comm_f, const float *in, float *out, long long count,
 *                     int iters, int repeats, double *times)
 *
 * op: 0 bcast, 1 scatter, 2 reduce, 3 allreduce, 4 gather, 5 allgather, 6 alltoall,
 *     7 sendrecv (a ring: to rank + 1, from rank - 1), 8 reduce_scatter
 *     (MPI_Reduce_scatter_block), 9 allreduce_rs_ag (an allreduce written as
 *     MPI_Reduce_scatter_block into this rank's block of `out`, then an in-place
 *     MPI_Allgather) (float32; sum; root 0).  comm_f: the communicator as a Fortran
 *     handle (mpi4py: comm.py2f()).  count: elements per block, i.e. the count
 *     argument of the MPI call (for scatter, alltoall, reduce_scatter and
 *     allreduce_rs_ag, `in` holds size blocks).
 * bcast, reduce and allreduce work in place on `out`, as mpicoll does when its
 * input is donated: MPI_Bcast(out), MPI_Allreduce(MPI_IN_PLACE, out),
 * MPI_Reduce(MPI_IN_PLACE, out) on the root and MPI_Reduce(out, NULL) elsewhere.
 * The other collectives read `in` and write `out`.  Every iteration uses the same
 * buffers.
 *
 * repeats == 0: `iters` calls, untimed (warm-up, or one call to check the result).
 * repeats > 0: for each repeat, a barrier, then `iters` calls timed with MPI_Wtime;
 * times[r] is the slowest rank's time for repeat r (seconds for all iters calls).
 * Returns MPI_SUCCESS or the first MPI error code.
 */
#include <mpi.h>
#include <stddef.h>

enum { BCAST, SCATTER, REDUCE, ALLREDUCE, GATHER, ALLGATHER, ALLTOALL, SENDRECV, REDUCE_SCATTER,
       ALLREDUCE_RS_AG };

static int call_once(int op, MPI_Comm comm, int rank, int size, const float *in, float *out,
                     int n) {
    int rc;
    switch (op) {
    case BCAST:
        return MPI_Bcast(out, n, MPI_FLOAT, 0, comm);
    case SCATTER:
        return MPI_Scatter(in, n, MPI_FLOAT, out, n, MPI_FLOAT, 0, comm);
    case REDUCE:
        if (rank == 0) return MPI_Reduce(MPI_IN_PLACE, out, n, MPI_FLOAT, MPI_SUM, 0, comm);
        return MPI_Reduce(out, NULL, n, MPI_FLOAT, MPI_SUM, 0, comm);
    case ALLREDUCE:
        return MPI_Allreduce(MPI_IN_PLACE, out, n, MPI_FLOAT, MPI_SUM, comm);
    case GATHER:
        return MPI_Gather(in, n, MPI_FLOAT, out, n, MPI_FLOAT, 0, comm);
    case ALLGATHER:
        return MPI_Allgather(in, n, MPI_FLOAT, out, n, MPI_FLOAT, comm);
    case ALLTOALL:
        return MPI_Alltoall(in, n, MPI_FLOAT, out, n, MPI_FLOAT, comm);
    case SENDRECV:
        return MPI_Sendrecv(in, n, MPI_FLOAT, (rank + 1) % size, 0, out, n, MPI_FLOAT,
                            (rank + size - 1) % size, 0, comm, MPI_STATUS_IGNORE);
    case REDUCE_SCATTER:
        return MPI_Reduce_scatter_block(in, out, n, MPI_FLOAT, MPI_SUM, comm);
    case ALLREDUCE_RS_AG:
        rc = MPI_Reduce_scatter_block(in, out + (size_t)rank * n, n, MPI_FLOAT, MPI_SUM, comm);
        if (rc != MPI_SUCCESS) return rc;
        return MPI_Allgather(MPI_IN_PLACE, n, MPI_FLOAT, out, n, MPI_FLOAT, comm);
    default:
        return MPI_ERR_OP;
    }
}

static int loop(int op, MPI_Comm comm, int rank, int size, const float *in, float *out, int n,
                int iters) {
    for (int i = 0; i < iters; ++i) {
        int rc = call_once(op, comm, rank, size, in, out, n);
        if (rc != MPI_SUCCESS) return rc;
    }
    return MPI_SUCCESS;
}

int mpi_floor_run(int op, int comm_f, const float *in, float *out, long long count, int iters,
                  int repeats, double *times) {
    MPI_Comm comm = MPI_Comm_f2c((MPI_Fint)comm_f);
    int rank, size, rc;
    if (count < 0 || count > 0x7fffffffLL) return MPI_ERR_COUNT;
    if ((rc = MPI_Comm_rank(comm, &rank)) != MPI_SUCCESS) return rc;
    if ((rc = MPI_Comm_size(comm, &size)) != MPI_SUCCESS) return rc;
    const int n = (int)count;
    if (repeats <= 0) return loop(op, comm, rank, size, in, out, n, iters);
    for (int r = 0; r < repeats; ++r) {
        if ((rc = MPI_Barrier(comm)) != MPI_SUCCESS) return rc;
        double start = MPI_Wtime();
        if ((rc = loop(op, comm, rank, size, in, out, n, iters)) != MPI_SUCCESS) return rc;
        double elapsed = MPI_Wtime() - start;
        rc = MPI_Allreduce(&elapsed, &times[r], 1, MPI_DOUBLE, MPI_MAX, comm);
        if (rc != MPI_SUCCESS) return rc;
    }
    return MPI_SUCCESS;
}
