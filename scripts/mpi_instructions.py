"""Instructions per MPI round trip by library, from scripts/mpi-instructions-guest's
profiles (rank 0 under callgrind, N1 and N2 round trips; the difference over N2 - N1 cancels
start-up). Prints a markdown table: one row per stack, a column per group of libraries.

    python3 scripts/mpi_instructions.py OUT N1 N2 STACK...
"""
import pathlib
import re
import sys
from collections import defaultdict

from callgrind_split import parse

# Groups, first match wins: the object's path against each pattern.
GROUPS = [
    ("rverbs", re.compile(r"librverbs-fi")),
    ("libfabric (core, rxm, verbs, shm)", re.compile(r"libfabric")),
    ("UCX", re.compile(r"libuc[ptsm]|/ucx/")),
    ("Open MPI pml/mtl", re.compile(r"mca_(pml|mtl)_")),
    ("Open MPI other", re.compile(r"libmpi|libopen-|openmpi|mca_")),
    ("verbs (libibverbs, rxe)", re.compile(r"libibverbs|rdmav|librxe")),
    ("libc", re.compile(r"libc\.so|ld-linux|libpthread")),
    ("program", re.compile(r"mpi-pingpong")),
]


def by_group(path):
    selfc, _, _, _ = parse(path)
    g = defaultdict(int)
    for (ob, _fn), c in selfc.items():
        name = next((n for n, p in GROUPS if p.search(ob or "")), "other")
        g[name] += c
    return g


def main():
    out, n1, n2, stacks = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    cols = [n for n, _ in GROUPS] + ["other"]
    print(f"| 2-byte MPI round trip, rank 0 ({n2 - n1} round trips' difference) | total | "
          + " | ".join(cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for s in stacks:
        a, b = out / "raw" / f"callgrind.{s}.{n1}.out", out / "raw" / f"callgrind.{s}.{n2}.out"
        if not (a.exists() and b.exists()):
            print(f"| {s} | – |" + " – |" * len(cols))
            continue
        ga, gb = by_group(a), by_group(b)
        per = {k: (gb.get(k, 0) - ga.get(k, 0)) / (n2 - n1) for k in set(ga) | set(gb)}
        total = sum(per.values())
        print(f"| {s} | {total:.0f} | " + " | ".join(f"{per.get(c, 0):.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
