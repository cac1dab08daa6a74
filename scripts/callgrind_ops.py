"""What kinds of instructions a round trip executes, per object: all of them, those that
touch memory (an operand in memory, push/pop, call/ret), returns, direct and indirect calls,
indirect jumps, atomics (lock-prefixed, xchg), spin-wait hints (pause) and time-stamp reads. Under QEMU's TCG, where the SoftRoCE VM
runs, a memory access costs a software TLB lookup and an indirect branch a translation-block
lookup, so two paths with equal instruction counts need not take equal time: this tells
whether they differ in kind as well as in number.

    python3 scripts/callgrind_ops.py RAW_PREFIX [--lines OBJECT [N] | --atomics OBJECT]

With --lines, the N (40) source lines of OBJECT (a substring of its path) whose
instructions run most per round trip, with their memory operations and atomics: each
instruction goes to the innermost line of its inline chain (addr2line -i), so a line of an
inlined helper counts wherever it was inlined. With --atomics, each atomic instruction of
OBJECT that runs, with the inline chain that reached it (whose lock, whose reference).

RAW_PREFIX names a pair of profiles taken with --dump-instr=yes by
`scripts/compare-guest --instructions` (RAW_PREFIX.1000.out and RAW_PREFIX.3000.out, 1000 and
3000 round trips); counts are their difference over 2000. The objects must be the files that
were profiled (rebuilt binaries no longer match their addresses: those counts show as
unmapped)."""
import re
import subprocess
import sys
from collections import defaultdict

from callgrind_split import parse

KINDS = ["all", "mem", "ret", "call", "call*", "jmp*", "atomic", "pause", "rdtsc", "unmapped"]


def kind(op, arg):
    if op.startswith("ret"):
        return "ret"
    if op.startswith("call"):
        return "call*" if "*" in arg else "call"
    if op.startswith("jmp") and "*" in arg:
        return "jmp*"
    # xchg with memory is locked; between registers (`xchg %ax,%ax` is a nop) it is not.
    if op.startswith("lock") or (op.startswith("xchg") and "(" in arg):
        return "atomic"
    # Under TCG a spin-wait hint costs ~180 ns and a time-stamp read ~26 ns
    # (results/rdm-gap/tcg-costs-36.txt).
    if op == "pause":
        return "pause"
    if op.startswith("rdtsc"):
        return "rdtsc"
    return None


def touches_memory(op, arg):
    if op.startswith(("push", "pop", "call", "ret")):
        return True
    return "(" in arg and not op.startswith(("lea", "nop"))


def disassemble(ob, lo, hi):
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", f"--start-address={lo}", f"--stop-address={hi + 16}", ob],
        capture_output=True,
        text=True,
    ).stdout
    ins = {}
    for line in out.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s*(\S+)\s*(.*)", line)
        if m:
            ins[int(m.group(1), 16)] = (m.group(2), m.group(3))
    return ins


def object_costs(prefix, want):
    """The object named like `want` in the pair of profiles, its instructions per round
    trip by address, and their disassembly."""
    a1 = parse(prefix + ".1000.out")[3]
    a3 = parse(prefix + ".3000.out")[3]
    costs = defaultdict(float)
    obj = None
    for key in set(a1) | set(a3):
        (ob, _fn), addr = key
        if want not in (ob or ""):
            continue
        obj = ob
        c = (a3.get(key, 0) - a1.get(key, 0)) / 2000
        if abs(c) > 0.001:
            costs[addr] += c
    if not costs:
        sys.exit(f"{prefix}: no instructions of an object named like {want}")
    return obj, costs, disassemble(obj, min(costs), max(costs))


def lines(prefix, want, top):
    obj, costs, ins = object_costs(prefix, want)
    addrs = sorted(costs)
    out = subprocess.run(["addr2line", "-a", "-i", "-e", obj], input="\n".join(hex(a) for a in addrs),
                         capture_output=True, text=True).stdout
    where, cur = {}, None
    for line in out.splitlines():
        if line.startswith("0x"):
            cur = int(line, 16)
        elif cur is not None and cur not in where:
            # The first line after the address is the innermost frame of the chain.
            where[cur] = re.sub(r".*/(src|sys|library)/", r"\1/", line.split(" (")[0])
    per = defaultdict(lambda: [0.0, 0.0, 0.0])
    for a, c in costs.items():
        op, arg = ins.get(a, ("?", ""))
        r = per[where.get(a, "?")]
        r[0] += c
        if touches_memory(op, arg):
            r[1] += c
        if kind(op, arg) == "atomic":
            r[2] += c
    print("per round trip | all | mem | atomic | line")
    for line, (n, m, at) in sorted(per.items(), key=lambda r: -r[1][0])[:top]:
        print(f"{n:8.1f} | {m:6.1f} | {at:4.1f} | {line}")


def atomics(prefix, want):
    """Each atomic instruction of the object named like `want` that runs, per round trip,
    with its whole inline chain (innermost first): who takes the lock or the reference."""
    obj, costs, ins = object_costs(prefix, want)
    hits = sorted(a for a in costs if kind(*ins.get(a, ("?", ""))) == "atomic")
    out = subprocess.run(["addr2line", "-a", "-i", "-f", "-C", "-e", obj], input="\n".join(hex(a) for a in hits),
                         capture_output=True, text=True).stdout
    chains, cur = defaultdict(list), None
    fn = None
    for line in out.splitlines():
        if line.startswith("0x"):
            cur, fn = int(line, 16), None
        elif fn is None:
            fn = re.sub(r"::h[0-9a-f]{16}$", "", line)
        else:
            at = re.sub(r".*/(src|sys|library)/", r"\1/", line.split(" (")[0])
            chains[cur].append(f"{fn} ({at})")
            fn = None
    print(f"{sum(costs[a] for a in hits):.1f} atomics per round trip")
    for a in hits:
        print(f"{costs[a]:6.1f}  {ins[a][0]} {ins[a][1]}")
        for frame in chains[a][:6]:
            print(f"          {frame}")


def main(prefix):
    a1 = parse(prefix + ".1000.out")[3]
    a3 = parse(prefix + ".3000.out")[3]
    if not a1 and not a3:
        sys.exit(f"{prefix}: no instruction addresses (profile with --dump-instr=yes)")
    per_ob = defaultdict(lambda: defaultdict(float))
    for key in set(a1) | set(a3):
        (ob, _fn), addr = key
        c = (a3.get(key, 0) - a1.get(key, 0)) / 2000
        if abs(c) > 0.001:
            per_ob[ob][addr] += c
    rows = {}
    for ob, costs in per_ob.items():
        ins = disassemble(ob, min(costs), max(costs))
        counts = defaultdict(float)
        for addr, c in costs.items():
            if addr not in ins:
                counts["unmapped"] += c
                continue
            op, arg = ins[addr]
            counts["all"] += c
            k = kind(op, arg)
            if k:
                counts[k] += c
            if touches_memory(op, arg):
                counts["mem"] += c
        rows[ob.split("/")[-1]] = counts
    total = defaultdict(float)
    print("per round trip | " + " | ".join(KINDS))
    for name, counts in sorted(rows.items(), key=lambda r: -r[1]["all"]):
        if counts["all"] < 1 and counts["unmapped"] < 1:
            continue
        print(f"{name} | " + " | ".join(f"{counts[k]:.1f}" for k in KINDS))
        for k in KINDS:
            total[k] += counts[k]
    print("total | " + " | ".join(f"{total[k]:.1f}" for k in KINDS))


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[2] == "--lines":
        lines(sys.argv[1], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 40)
    elif len(sys.argv) == 4 and sys.argv[2] == "--atomics":
        atomics(sys.argv[1], sys.argv[3])
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        sys.exit(__doc__)
