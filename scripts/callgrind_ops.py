"""What kinds of instructions a round trip executes, per object: all of them, those that
touch memory (an operand in memory, push/pop, call/ret), returns, direct and indirect calls,
indirect jumps, atomics (lock-prefixed, xchg), spin-wait hints (pause) and time-stamp reads. Under QEMU's TCG, where the SoftRoCE VM
runs, a memory access costs a software TLB lookup and an indirect branch a translation-block
lookup, so two paths with equal instruction counts need not take equal time: this tells
whether they differ in kind as well as in number.

    python3 scripts/callgrind_ops.py RAW_PREFIX

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
    if op.startswith("lock") or op.startswith("xchg"):
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
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
