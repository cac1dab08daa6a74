"""An mpi4py application: point-to-point (blocking, non-blocking, probe and matched probe,
wildcards, synchronous sends, cancel) and collectives, results checked. Run by scripts/mpi
with Debian's python3-mpi4py; rank 0 prints "app.py: ok, N checks"."""
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
checks = 0


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        sys.stderr.write(f"app.py: rank {rank}: {what}\n")
        comm.Abort(1)


nxt, prv = (rank + 1) % size, (rank - 1) % size
# Blocking and non-blocking, objects and buffers, sizes past the eager and segmented sizes.
for n in (1, 8161, 70000, 1 << 20):
    data = bytearray((i * 7 + rank + n) % 256 for i in range(n))
    req = comm.Isend([data, MPI.BYTE], dest=nxt, tag=n % 1000)
    got = bytearray(n)
    comm.Recv([got, MPI.BYTE], source=prv, tag=n % 1000)
    req.Wait()
    check(got == bytearray((i * 7 + prv + n) % 256 for i in range(n)), f"{n} bytes from {prv}")
obj = comm.sendrecv({"rank": rank, "list": list(range(rank + 3))}, dest=nxt, source=prv)
check(obj == {"rank": prv, "list": list(range(prv + 3))}, "pickled object")
# Probe and matched probe with wildcards.
comm.send(("probe", rank), dest=0, tag=50 + rank)
if rank == 0:
    seen = set()
    for _ in range(size):
        st = MPI.Status()
        comm.Probe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
        msg = comm.recv(source=st.Get_source(), tag=st.Get_tag())
        check(msg == ("probe", st.Get_source()) and st.Get_tag() == 50 + st.Get_source(),
              f"probe: source {st.Get_source()} tag {st.Get_tag()} message {msg!r}")
        seen.add(st.Get_source())
    check(seen == set(range(size)), "every rank probed")
# Later messages (tag 77 from the last rank to rank 0) wait until the wildcard probes are done.
comm.Barrier()
comm.send(rank * 10, dest=nxt, tag=77)
m = comm.mprobe(source=MPI.ANY_SOURCE, tag=77)
check(m.recv() == prv * 10, "mprobe")
# Synchronous send, and a cancelled receive.
r = comm.irecv(source=prv, tag=88)
comm.ssend(rank, dest=nxt, tag=88)
check(r.wait() == prv, "ssend")
buf = bytearray(8)
r = comm.Irecv([buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=999)
r.Cancel()
st = MPI.Status()
r.Wait(st)
check(st.Is_cancelled(), "cancelled receive")
# Collectives.
check(comm.bcast("root" if rank == 0 else None, root=0) == "root", "bcast")
check(comm.allreduce(rank + 1, op=MPI.SUM) == size * (size + 1) // 2, "allreduce")
check(comm.alltoall([(rank, p) for p in range(size)]) == [(p, rank) for p in range(size)], "alltoall")
comm.Barrier()
total = comm.reduce(checks, op=MPI.SUM, root=0)
if rank == 0:
    print(f"app.py: ok, {total} checks on {size} ranks", flush=True)
