"""Splits a callgrind profile of one of our tools into who spent the instructions:
rverbs itself (functions of the rfabric crates, with the libc calls they make), the tool
(its own functions and their libc calls), the device provider (libibverbs and the rxe
provider, or any lib*-rdmav*), and the rest. Used by compare-guest --instructions.

    python3 scripts/callgrind_split.py FILE [TOOL_CRATE]

Cross-crate inlining moves rverbs code into the tool's functions: inside a tool function,
an instruction whose inline chain (addr2line -i, from a profile taken with
--dump-instr=yes) passes through an rfabric source file counts as rverbs' own, so that
neither rverbs' code nor the standard library code it inlines (its locks, atomics and
options) can hide in the tool. Without instruction addresses, the innermost source line
decides (callgrind's fi=/fe= records), which leaves std code inlined through rverbs to the
tool. Functions outside both (std's out-of-line lock, say) go to their callers' shares."""
import re, subprocess, sys
from collections import defaultdict

DEVICE = re.compile(r"libibverbs|rdmav|librxe|libmlx|libefa")
LIBC = re.compile(r"libc\.so|libc-|ld-linux|libpthread|libgcc")
# rfabric's own sources (the library and sys/), not the tools under src/bin.
RFABRIC_SRC = re.compile(r"/(src/(verbs|core|capi)/|src/lib\.rs|src/verbs\.rs|sys/src/)")
# The tools' clock lives in rfabric_sys, but reading it inside a tool's loop is the tool's.
TOOL_UTIL = re.compile(r"/sys/src/clock\.rs")


def parse(path):
    """Returns (self cost by (object, function), inclusive call costs by (caller, callee),
    self cost from rfabric source lines by function, self cost by (object, function,
    instruction address) when the profile has addresses)."""
    names = {"ob": {}, "fn": {}, "fl": {}}
    selfc = defaultdict(int)
    ours = defaultdict(int)
    by_addr = defaultdict(int)
    fl_file = cur_file = ""
    calls = defaultdict(int)
    ob = fn = None
    cob = cfn = None
    pending_call = False
    positions = 1
    has_instr = False
    pos = [0, 0]

    def name(kind, v):
        m = re.match(r"\((\d+)\)(?: (.*))?", v)
        if not m:
            return v
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
            return m.group(2)
        return names[kind][m.group(1)]

    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("positions:"):
                positions = len(line.split()) - 1
                has_instr = line.split()[1] == "instr"
            elif line.startswith("ob="):
                ob = name("ob", line[3:])
            elif line.startswith("fl="):
                fl_file = cur_file = name("fl", line[3:])
            elif line.startswith(("fi=", "fe=")):
                cur_file = name("fl", line[3:])
            elif line.startswith(("cfi=", "cfl=")):
                name("fl", line[4:])  # a callee's file: only its name is defined here
            elif line.startswith("fn="):
                fn = (ob, name("fn", line[3:]))
                cur_file = fl_file
                cob = None
            elif line.startswith("cob="):
                cob = name("ob", line[4:])
            elif line.startswith("cfn="):
                cfn = name("fn", line[4:])
            elif line.startswith("calls="):
                pending_call = True
            elif line and (line[0].isdigit() or line[0] in "+-*"):
                parts = line.split()
                # Positions are absolute, or relative to the previous line's ("+3", "-2", "*").
                for i in range(min(positions, 2)):
                    t = parts[i]
                    if t == "*":
                        continue
                    pos[i] = pos[i] + int(t, 0) if t[0] in "+-" else int(t, 0)
                cost = int(parts[positions]) if len(parts) > positions else 0
                if pending_call:
                    calls[(fn, (cob or ob, cfn))] += cost
                    pending_call = False
                    cob = None
                else:
                    selfc[fn] += cost
                    if has_instr:
                        by_addr[(fn, pos[0])] += cost
                    if RFABRIC_SRC.search(cur_file or ""):
                        ours[fn] += cost
    return selfc, calls, ours, by_addr


def inlined_ours(by_addr, keys):
    """Self cost of the functions `keys` on instructions whose inline chain passes through
    an rfabric source file (addr2line -i on the object), by function; None without
    addresses or addr2line."""
    want = defaultdict(list)
    for (k, a), c in by_addr.items():
        if k in keys and c:
            want[k[0]].append(a)
    if not want:
        return None
    chains = {}
    for ob, addrs in want.items():
        addrs = sorted(set(addrs))
        try:
            # Addresses on stdin: a tool's functions can hold more than a command line takes.
            out = subprocess.run(["addr2line", "-a", "-i", "-e", ob],
                                 input="\n".join(hex(a) for a in addrs),
                                 capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        cur = None
        for line in out.splitlines():
            if line.startswith("0x"):
                cur = (ob, int(line, 16))
                chains[cur] = False
            elif cur is not None and RFABRIC_SRC.search(line) and not TOOL_UTIL.search(line):
                chains[cur] = True
    res = defaultdict(int)
    for (k, a), c in by_addr.items():
        if k in keys and chains.get((k[0], a)):
            res[k] += c
    return res


def demangle(syms):
    """callgrind demangles Rust names itself; c++filt covers any it left mangled."""
    raw = [s for s in syms if s.startswith("_Z")]
    d = {s: s for s in syms}
    if raw:
        try:
            out = subprocess.run(["c++filt"], input="\n".join(raw), capture_output=True, text=True).stdout.splitlines()
            if len(out) == len(raw):
                d.update(zip(raw, out))
        except OSError:
            pass
    return d


def split(path, tool):
    selfc, calls, ours, by_addr = parse(path)
    syms = sorted({f for (_, f) in selfc} | {f for (_, (_, f)) in calls})
    dm = demangle(syms)

    def who(key):
        ob, f = key
        n = dm.get(f, f)
        if DEVICE.search(ob or ""):
            return "device"
        if LIBC.search(ob or ""):
            return "libc"
        if n.startswith(tool + "::") or ("<" + tool + "::") in n or n.startswith("common::"):
            return "tool"
        if "rfabric" in n:
            return "rverbs"
        return "other"

    out = defaultdict(int)
    for k, c in selfc.items():
        out[who(k)] += c
    # rverbs inlined into the tool's functions is rverbs', with what it inlined itself.
    tool_fns = {k for k in selfc if who(k) == "tool"}
    chained = inlined_ours(by_addr, tool_fns)
    moved = defaultdict(int)
    for k, c in (chained if chained is not None else ours).items():
        if who(k) == "tool":
            out["tool"] -= c
            out["rverbs"] += c
            moved[dm.get(k[1], k[1])] += c
    # A function of neither (std's out-of-line Mutex::lock, say) is its callers': its self
    # cost is shared among rverbs and the tool by what each call of it cost them.
    into = defaultdict(lambda: defaultdict(int))
    for (caller, callee), c in calls.items():
        if who(callee) == "other" and who(caller) in ("rverbs", "tool"):
            into[callee][who(caller)] += c
    for callee, shares in into.items():
        total = sum(c for (cr, ce), c in calls.items() if ce == callee)
        own = selfc.get(callee, 0)
        for b, c in shares.items():
            part = own * c / total if total else 0
            out["other"] -= part
            out[b] += part
            if b == "rverbs":
                moved["(called) " + dm.get(callee[1], callee[1])] += part
    # libc called by rverbs or by the tool is theirs (memcpy, memset, locks).
    for (caller, callee), c in calls.items():
        a, b = who(caller), who(callee)
        if b == "libc" and a in ("rverbs", "tool"):
            out[a] += c
            out["libc"] -= c
    by_fn = defaultdict(int)
    for k, c in selfc.items():
        if who(k) == "rverbs":
            by_fn[dm.get(k[1], k[1])] += c
    for n, c in moved.items():
        by_fn[n if n.startswith("(called) ") else "(inlined) " + n] += c
    return dict(out), by_fn


if __name__ == "__main__":
    parts, fns = split(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "rfab_send_lat")
    print(parts)
    for n, c in sorted(fns.items(), key=lambda x: -x[1])[:40]:
        print(f"{c:>12} {n}")
