//! The test loops: the sizes to run, the ping-pong latency loop and the windowed-send loop.

use std::io::{BufReader, Write};
use std::time::Duration;

use rfabric::core::cq::CqMsgEntry;
use rfabric::verbs::RmaIov;
use rfabric::*;
use rfabric_sys::clock::{cycles, cycles_per_us};

use super::oob::read_line;
use super::options::{Opts, Test, MAX_ALL};
use super::setup::Conn;
use super::tables::Samples;

const WARMUP: usize = 100;
/// Sends per requested completion in the bandwidth test (perftest's default `--cq-mod`).
const CQ_MOD: usize = 100;

/// The sizes to run: one, or every power of two from 2 B up to the largest message.
pub(crate) fn sizes(o: &Opts, c: &Conn) -> Vec<usize> {
    let max = c.info.ep_attr.max_msg_size.min(MAX_ALL).min(c.rx.len());
    if o.all {
        (1..)
            .map(|k| 1usize << k)
            .take_while(|&s| s <= max)
            .collect()
    } else {
        vec![o.size]
    }
}

/// A timeout that costs a TSC read to check, and is checked only every 4096 empty polls.
pub(crate) struct Deadline {
    end: u64,
    polls: u32,
}

impl Deadline {
    pub(crate) fn after(d: Duration) -> Self {
        Deadline {
            end: cycles() + (d.as_secs_f64() * 1e6 * cycles_per_us()) as u64,
            polls: 0,
        }
    }

    #[inline]
    pub(crate) fn passed(&mut self) -> bool {
        self.polls = self.polls.wrapping_add(1);
        self.polls % 4096 == 0 && cycles() > self.end
    }
}

/// `RFAB_SETTLE_US`: wait this long before reading for a round trip's completions. Only for
/// counting instructions (`scripts/compare-guest --instructions`): the completions are then
/// there at the first read, so the count holds the provider's work and no waiting spins,
/// whose number follows how busy the machine is.
fn settle() -> Option<Duration> {
    static SETTLE: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *SETTLE.get_or_init(|| {
        std::env::var("RFAB_SETTLE_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_micros)
    })
}

/// The wait `settle` asks for. Out of line and named, so that the instruction count leaves
/// it out (`scripts/compare-guest` runs callgrind with `--toggle-collect=*settle_pause*`):
/// it stands in for the waiting spins, and is no more the tool's work than they are.
#[inline(never)]
fn settle_pause(d: Duration) {
    std::thread::sleep(d);
}

/// `RFAB_PHASES`: where a ping-pong's time goes on each side, printed to stderr after each
/// size: the send call (the doorbell's system call runs the device's work in rxe), the read
/// that finds the peer's message, the empty reads before it, and posting the receive. Each
/// phase is timed with the TSC, so the round trips it measures are a little slower.
#[derive(Default)]
struct Phases {
    on: bool,
    send: u64,
    hit: u64,
    empty: u64,
    empties: u64,
    recv: u64,
}

impl Phases {
    fn from_env() -> Self {
        Phases {
            on: std::env::var_os("RFAB_PHASES").is_some(),
            ..Self::default()
        }
    }

    /// Runs `f`, adding its cycles to the phase `at` picks when timing is on.
    #[inline(always)]
    fn time<T>(&mut self, at: fn(&mut Self) -> &mut u64, f: impl FnOnce() -> T) -> T {
        if !self.on {
            return f();
        }
        let t0 = cycles();
        let r = f();
        *at(self) += cycles().wrapping_sub(t0);
        r
    }

    fn report(&self, c: &Conn, size: usize, rounds: usize) {
        if !self.on {
            return;
        }
        let ns = |v: u64, n: u64| v as f64 * 1e3 / cycles_per_us() / n.max(1) as f64;
        let n = rounds as u64;
        eprintln!(
            "phases ({}, {size} B, per round trip): send call {:.0} ns, the read that finds \
             the message {:.0} ns, {:.1} empty reads of {:.0} ns, receive post {:.0} ns",
            if c.is_server { "server" } else { "client" },
            ns(self.send, n),
            ns(self.hit, n),
            self.empties as f64 / n.max(1) as f64,
            ns(self.empty, self.empties),
            ns(self.recv, n),
        );
    }
}

/// Counts completions until `recvs` receives were seen; sends are reaped on the way.
/// Returns how many send completions were reaped.
fn reap(c: &Conn, recvs: usize, deadline: &mut Deadline, ph: &mut Phases) -> Result<usize, String> {
    let mut out = c.entries.borrow_mut();
    let (mut got, mut sends) = (0, 0);
    if let Some(d) = settle() {
        settle_pause(d);
    }
    while got < recvs {
        let t0 = if ph.on { cycles() } else { 0 };
        let n = poll(c, &mut out[..], deadline, || {
            "the peer stopped answering".into()
        })?;
        if ph.on {
            let (dt, hit) = (cycles().wrapping_sub(t0), out[..n].iter().any(is_recv));
            *(if hit { &mut ph.hit } else { &mut ph.empty }) += dt;
            ph.empties += u64::from(!hit);
        }
        for e in &out[..n] {
            if is_recv(e) {
                got += 1;
            } else {
                sends += 1;
            }
        }
    }
    Ok(sends)
}

fn is_recv(e: &CqMsgEntry) -> bool {
    e.flags & Flags::RECV.bits() != 0
}

/// One read of the CQ into `out`: how many completions came (0 when none), an error
/// completion as its text, `stalled` once the deadline has passed with nothing coming.
#[inline(always)]
fn poll(
    c: &Conn,
    out: &mut [CqMsgEntry],
    deadline: &mut Deadline,
    stalled: impl FnOnce() -> String,
) -> Result<usize, String> {
    match c.cq.read(out) {
        Ok(n) => Ok(n),
        Err(e) if e.is_again() => {
            if deadline.passed() {
                return Err(stalled());
            }
            Ok(0)
        }
        Err(e) if e.errno() == errno::EAVAIL => {
            let err = c.cq.readerr().map_err(|e| e.to_string())?;
            Err(format!(
                "completion error: {} ({})",
                rfabric::core::error::strerror(err.err),
                c.cq.strerror(err.prov_errno)
            ))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// What the initiator's completions carry: sends, RDMA writes and reads.
const INITIATOR: u64 = Flags::SEND.bits() | Flags::WRITE.bits() | Flags::READ.bits();

/// Reads until `n` send (or RDMA) completions were seen.
fn reap_sends(c: &Conn, mut n: usize, deadline: &mut Deadline) -> Result<(), String> {
    let mut out = c.entries.borrow_mut();
    while n > 0 {
        let k = poll(c, &mut out[..], deadline, || {
            "send completions stopped".into()
        })?;
        n = n.saturating_sub(out[..k].iter().filter(|e| e.flags & INITIATOR != 0).count());
    }
    Ok(())
}

/// The server's end of a size: one message back to the client, which closes the size.
fn answer(c: &Conn, deadline: &mut Deadline) -> Result<(), String> {
    c.ep.sendmsg(&c.tx, 0, 3, Flags::COMPLETION)
        .map_err(|e| e.to_string())?;
    reap_sends(c, 1, deadline)
}

/// The end of a one-sided size, as perftest's: over the control connection, where the
/// server sleeps in a read until the client says it is done. An idle server leaves its CPU
/// to the device's work at its end (read responses, writes placed), which runs in this
/// host's kernel and which a polling server would compete with.
fn rma_sync(c: &Conn) -> Result<(), String> {
    let say = |line: &str| {
        (&c.control)
            .write_all(line.as_bytes())
            .map_err(|e| format!("control connection: {e}"))
    };
    let hear = |want: &str, what: &str| {
        let got = read_line(&mut BufReader::new(&c.control), what)?;
        match got == want {
            true => Ok(()),
            false => Err(format!("the peer sent {got:?} for {what}")),
        }
    };
    if c.is_server {
        hear("done", "the client's end of the size")?;
        say("ok\n")
    } else {
        say("done\n")?;
        hear("ok", "the server's answer")
    }
}

/// The peer's buffer as the remote range of `size` bytes of a one-sided operation.
fn rma_target(c: &Conn, size: usize) -> Result<RmaIov, String> {
    let (addr, key) = c.remote.ok_or("the peer's buffer is unknown")?;
    Ok(RmaIov {
        addr,
        len: size,
        key,
    })
}

/// Ping-pong: the client times round trips; one-way latency is half of each.
// Out of line, so the loop runs in a small frame of its own, not in `main`'s (5 KiB: its
// locals there spread over more stack pages, each touched every round trip).
#[inline(never)]
pub(crate) fn run_lat(
    c: &Conn,
    size: usize,
    iters: usize,
    timeout: Duration,
) -> Result<Samples, String> {
    // A fixed warm-up: runs that differ only in -n then differ by exactly that many round
    // trips, which the instruction-count comparison relies on.
    let warmup = WARMUP;
    let mut samples = Samples::with_capacity(iters, 2.0);
    let deadline = &mut Deadline::after(timeout);
    let e = |e: Error| e.to_string();
    let mut unreaped = 0usize;
    let ph = &mut Phases::from_env();
    for i in 0..warmup + iters {
        let t0 = cycles();
        // One send completion in CQ_MOD (and the last), as perftest's latency tests ask.
        let signal = (i + 1) % CQ_MOD == 0 || i + 1 == warmup + iters;
        let send = || {
            if signal {
                c.ep.sendmsg(&c.tx, size, 2, Flags::COMPLETION)
            } else {
                c.ep.send(&c.tx, 0, size, 2)
            }
        };
        let recv = || c.ep.recv(&c.rx, 0, c.rx.len(), 1);
        if c.is_server {
            unreaped -= reap(c, 1, deadline, ph)?.min(unreaped);
            ph.time(|p| &mut p.recv, recv).map_err(e)?;
            ph.time(|p| &mut p.send, send).map_err(e)?;
            unreaped += usize::from(signal);
        } else {
            ph.time(|p| &mut p.send, send).map_err(e)?;
            unreaped += usize::from(signal);
            unreaped -= reap(c, 1, deadline, ph)?.min(unreaped);
            ph.time(|p| &mut p.recv, recv).map_err(e)?;
        }
        if i >= warmup && !c.is_server {
            samples.cycles.push(cycles().wrapping_sub(t0));
        }
    }
    reap_sends(c, unreaped, deadline)?;
    ph.report(c, size, warmup + iters);
    Ok(samples)
}

/// Windowed operations: the client keeps `depth` sends (or RDMA writes or reads of the
/// server's buffer) in flight. The server counts arrivals, or for one-sided tests waits for
/// the client's word, and answers with one message. Returns (total seconds, best window in
/// bytes per microsecond).
// Out of line, so the loop runs in a small frame of its own, not in `main`'s (5 KiB: its
// locals there spread over more stack pages, each touched every round trip).
#[inline(never)]
pub(crate) fn run_bw(
    c: &Conn,
    test: Test,
    size: usize,
    iters: usize,
    depth: usize,
    timeout: Duration,
) -> Result<(f64, f64), String> {
    let deadline = &mut Deadline::after(timeout);
    let e = |e: Error| e.to_string();
    let mut out = [CqMsgEntry::default(); 16];
    if c.is_server && test != Test::SendBw {
        // Writes and reads pass unseen: the client's word over the control connection.
        rma_sync(c)?;
        return Ok((0.0, 0.0));
    }
    if c.is_server {
        // Sends arrive one by one.
        let mut got = 0;
        while got < iters {
            let n = poll(c, &mut out, deadline, || {
                format!("only {got} of {iters} messages arrived")
            })?;
            for en in &out[..n] {
                if en.flags & Flags::RECV.bits() != 0 {
                    if en.len != size {
                        return Err(format!("received {} bytes, expected {size}", en.len));
                    }
                    got += 1;
                    c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
                }
            }
        }
        answer(c, deadline)?;
        return Ok((0.0, 0.0));
    }
    let rma = rma_target(c, size);
    // One completion in CQ_MOD (and the last): RC completes a queue in order, so a
    // completion for operation k means operations 0..=k are done. A window smaller than
    // that asks for one per window, as perftest lowers its cq_mod to the tx depth (else the
    // window fills with operations that never report).
    let every = CQ_MOD.min(depth);
    let post = |k: usize| -> Result<()> {
        let flags = if (k + 1) % every == 0 || k + 1 == iters {
            Flags::COMPLETION
        } else {
            Flags::empty()
        };
        let ctx = k as u64;
        match (test, &rma) {
            (Test::WriteBw, Ok(r)) => c.ep.msg()?.writemsg(&[(&c.tx, 0, size)], r, ctx, 0, flags),
            (Test::ReadBw, Ok(r)) => c.ep.msg()?.readmsg(&[(&c.tx, 0, size)], r, ctx, flags),
            _ if flags.is_empty() => c.ep.send(&c.tx, 0, size, ctx),
            _ => c.ep.sendmsg(&c.tx, size, ctx, flags),
        }
    };
    let per_us = cycles_per_us();
    let (mut posted, mut done, mut answered) = (0usize, 0usize, 0usize);
    let start = cycles();
    let (mut window_start, mut window_done) = (start, 0usize);
    let mut peak: f64 = 0.0;
    while done < iters {
        while posted < iters && posted - done < depth {
            match post(posted) {
                Ok(()) => posted += 1,
                Err(er) if er.is_again() => break,
                Err(er) => return Err(er.to_string()),
            }
        }
        let n = poll(c, &mut out, deadline, || {
            format!("only {done} of {iters} operations completed")
        })?;
        for en in &out[..n] {
            if en.flags & INITIATOR != 0 {
                done = done.max(en.op_context as usize + 1);
            } else {
                // The server's answer can overtake our last send completions.
                answered += 1;
            }
        }
        if done - window_done >= depth {
            let now = cycles();
            let us = now.wrapping_sub(window_start) as f64 / per_us;
            if us > 0.0 {
                peak = peak.max(((done - window_done) * size) as f64 / us);
            }
            (window_start, window_done) = (now, done);
        }
    }
    let secs = cycles().wrapping_sub(start) as f64 / per_us / 1e6;
    if test != Test::SendBw {
        rma_sync(c)?;
        return Ok((secs, peak));
    }
    // The server's answer closes the size: it has counted every message.
    if answered == 0 {
        reap(c, 1, deadline, &mut Phases::default())?;
    }
    c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
    Ok((secs, peak))
}

/// RDMA read latency (perftest's read_lat): the client reads `size` bytes of the server's
/// buffer, one read at a time, and times each to its completion. A read is a round trip
/// in itself, so the latency is the whole of it, as perftest reports. The server only
/// waits for the client's word that the size is done.
// Out of line, so the loop runs in a small frame of its own, not in `main`'s (5 KiB: its
// locals there spread over more stack pages, each touched every round trip).
#[inline(never)]
pub(crate) fn run_read_lat(
    c: &Conn,
    size: usize,
    iters: usize,
    timeout: Duration,
) -> Result<Samples, String> {
    let deadline = &mut Deadline::after(timeout);
    if c.is_server {
        rma_sync(c)?;
        return Ok(Samples::with_capacity(0, 1.0));
    }
    let ep = c.ep.msg().map_err(|e| e.to_string())?;
    let rma = rma_target(c, size)?;
    let warmup = WARMUP.min(((64 << 20) / size.max(1)).max(1));
    let mut samples = Samples::with_capacity(iters, 1.0);
    let mut out = c.entries.borrow_mut();
    for i in 0..warmup + iters {
        let t0 = cycles();
        ep.readmsg(&[(&c.tx, 0, size)], &rma, 1, Flags::COMPLETION)
            .map_err(|e| e.to_string())?;
        while poll(c, &mut out[..1], deadline, || {
            format!("a {size}-byte read did not complete")
        })? == 0
        {}
        if i >= warmup {
            samples.cycles.push(cycles().wrapping_sub(t0));
        }
    }
    drop(out);
    rma_sync(c)?;
    Ok(samples)
}

/// RDMA write ping-pong (perftest's write latency test): each side writes `size` bytes into
/// the peer's buffer, whose last byte carries the round's number (1 to 255, so a byte the
/// previous size left at 0 never reads as a round), and polls its own buffer's last byte
/// for the peer's. Writes are signalled one in CQ_MOD; their completions are reaped while
/// polling. Returns the client's one-way latencies.
// Out of line, so the loop runs in a small frame of its own, not in `main`'s (5 KiB: its
// locals there spread over more stack pages, each touched every round trip).
#[inline(never)]
pub(crate) fn run_write_lat(
    c: &Conn,
    size: usize,
    iters: usize,
    timeout: Duration,
) -> Result<Samples, String> {
    let size = size.max(1);
    let rma = rma_target(c, size)?;
    let ep = c.ep.msg().map_err(|e| e.to_string())?;
    let e = |e: Error| e.to_string();
    let deadline = &mut Deadline::after(timeout);
    let mut samples = Samples::with_capacity(iters, 2.0);
    let last = size - 1;
    let mut unreaped = 0usize;
    let mut out = c.entries.borrow_mut();
    // Large sizes warm up on at most 64 MiB (8 rounds of 8 MiB): under TCG a full warm-up
    // of them takes longer than a timeout.
    let warmup = WARMUP.min(((64 << 20) / size).max(1));
    let mut wait_for = |round: u8, unreaped: &mut usize| -> Result<(), String> {
        if let Some(d) = settle() {
            settle_pause(d);
        }
        while c.rx.byte_at(last).map_err(e)? != round {
            let stalled =
                || format!("the peer stopped writing ({size} bytes, waiting for round {round})");
            if *unreaped > 0 {
                *unreaped -= poll(c, &mut out[..], deadline, stalled)?.min(*unreaped);
            } else if deadline.passed() {
                return Err(stalled());
            }
            // No spin hint: perftest's loop has none, and under QEMU's TCG a PAUSE leaves
            // the vCPU's translated code each time, which delays seeing the byte land.
        }
        Ok(())
    };
    for i in 0..warmup + iters {
        let round = (i % 255) as u8 + 1;
        let signal = (i + 1) % CQ_MOD == 0 || i + 1 == warmup + iters;
        let t0 = cycles();
        if c.is_server {
            wait_for(round, &mut unreaped)?;
        }
        c.tx.write_at(last, &[round]).map_err(e)?;
        if signal {
            ep.writemsg(&[(&c.tx, 0, size)], &rma, 2, 0, Flags::COMPLETION)
                .map_err(e)?;
            unreaped += 1;
        } else {
            ep.write(&c.tx, 0, size, rma.addr, rma.key, 2).map_err(e)?;
        }
        if !c.is_server {
            wait_for(round, &mut unreaped)?;
            if i >= warmup {
                samples.cycles.push(cycles().wrapping_sub(t0));
            }
        }
    }
    drop(out);
    reap_sends(c, unreaped, deadline)?;
    Ok(samples)
}
