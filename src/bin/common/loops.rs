//! The test loops: the sizes to run, the ping-pong latency loop and the windowed-send loop.

use std::time::Duration;

use rfabric::core::cq::CqEntry;
use rfabric::*;
use rfabric_sys::clock::{cycles, cycles_per_us};

use super::options::{Opts, MAX_ALL};
use super::setup::Conn;

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

/// Counts completions until `recvs` receives were seen; sends are reaped on the way.
/// Returns how many send completions were reaped.
fn reap(c: &Conn, recvs: usize, deadline: &mut Deadline) -> Result<usize, String> {
    let mut out = c.entries.borrow_mut();
    let (mut got, mut sends) = (0, 0);
    if let Some(d) = settle() {
        std::thread::sleep(d);
    }
    while got < recvs {
        match c.cq.read(&mut out[..]) {
            Ok(n) => {
                for e in &out[..n] {
                    if e.flags & Flags::RECV.bits() != 0 {
                        got += 1;
                    } else {
                        sends += 1;
                    }
                }
            }
            Err(e) if e.is_again() => {
                if deadline.passed() {
                    return Err("the peer stopped answering".into());
                }
            }
            Err(e) if e.errno() == errno::EAVAIL => {
                let err = c.cq.readerr().map_err(|e| e.to_string())?;
                return Err(format!(
                    "completion error: {} ({})",
                    rfabric::core::error::strerror(err.err),
                    c.cq.strerror(err.prov_errno)
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(sends)
}

fn reap_sends(c: &Conn, mut n: usize, deadline: &mut Deadline) -> Result<(), String> {
    let mut out = c.entries.borrow_mut();
    while n > 0 {
        match c.cq.read(&mut out[..]) {
            Ok(k) => {
                n = n.saturating_sub(
                    out[..k]
                        .iter()
                        .filter(|e| e.flags & Flags::SEND.bits() != 0)
                        .count(),
                )
            }
            Err(e) if e.is_again() => {
                if deadline.passed() {
                    return Err("send completions stopped".into());
                }
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// Ping-pong: the client times round trips; one-way latency is half of each.
pub(crate) fn run_lat(
    c: &Conn,
    size: usize,
    iters: usize,
    timeout: Duration,
) -> Result<Vec<f64>, String> {
    // A fixed warm-up: runs that differ only in -n then differ by exactly that many round
    // trips, which the instruction-count comparison relies on.
    let warmup = WARMUP;
    let mut samples = Vec::with_capacity(iters);
    let deadline = &mut Deadline::after(timeout);
    let e = |e: Error| e.to_string();
    let per_us = cycles_per_us();
    let mut unreaped = 0usize;
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
        if c.is_server {
            unreaped -= reap(c, 1, deadline)?.min(unreaped);
            c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
            send().map_err(e)?;
            unreaped += usize::from(signal);
        } else {
            send().map_err(e)?;
            unreaped += usize::from(signal);
            unreaped -= reap(c, 1, deadline)?.min(unreaped);
            c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
        }
        if i >= warmup && !c.is_server {
            samples.push(cycles().wrapping_sub(t0) as f64 / per_us / 2.0);
        }
    }
    reap_sends(c, unreaped, deadline)?;
    Ok(samples)
}

/// Windowed sends: the client keeps `depth` sends in flight; the server counts arrivals and
/// answers with one message when all have come. Returns (total seconds, best window MB/s).
pub(crate) fn run_bw(
    c: &Conn,
    size: usize,
    iters: usize,
    depth: usize,
    timeout: Duration,
) -> Result<(f64, f64), String> {
    let deadline = &mut Deadline::after(timeout);
    let e = |e: Error| e.to_string();
    let mut out = [CqEntry::default(); 16];
    if c.is_server {
        let mut got = 0;
        while got < iters {
            match c.cq.read(&mut out) {
                Ok(n) => {
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
                Err(er) if er.is_again() => {
                    if deadline.passed() {
                        return Err(format!("only {got} of {iters} messages arrived"));
                    }
                }
                Err(er) => return Err(er.to_string()),
            }
        }
        c.ep.send(&c.tx, 0, 0, 3).map_err(e)?;
        reap_sends(c, 1, deadline)?;
        return Ok((0.0, 0.0));
    }
    let per_us = cycles_per_us();
    let (mut posted, mut done, mut answered) = (0usize, 0usize, 0usize);
    let start = cycles();
    let (mut window_start, mut window_done) = (start, 0usize);
    let mut peak: f64 = 0.0;
    while done < iters {
        while posted < iters && posted - done < depth {
            // One completion in CQ_MOD (and the last): RC completes sends in order, so a
            // completion for send k means sends 0..=k are done.
            let r = if (posted + 1) % CQ_MOD == 0 || posted + 1 == iters {
                c.ep.sendmsg(&c.tx, size, posted as u64, Flags::COMPLETION)
            } else {
                c.ep.send(&c.tx, 0, size, posted as u64)
            };
            match r {
                Ok(()) => posted += 1,
                Err(er) if er.is_again() => break,
                Err(er) => return Err(er.to_string()),
            }
        }
        match c.cq.read(&mut out) {
            Ok(n) => {
                for en in &out[..n] {
                    if en.flags & Flags::SEND.bits() != 0 {
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
            Err(er) if er.is_again() => {
                if deadline.passed() {
                    return Err(format!("only {done} of {iters} sends completed"));
                }
            }
            Err(er) if er.errno() == errno::EAVAIL => {
                let err = c.cq.readerr().map_err(|e| e.to_string())?;
                return Err(format!(
                    "send failed: {} ({})",
                    rfabric::core::error::strerror(err.err),
                    c.cq.strerror(err.prov_errno)
                ));
            }
            Err(er) => return Err(er.to_string()),
        }
    }
    let secs = cycles().wrapping_sub(start) as f64 / per_us / 1e6;
    // The server's answer closes the size: it has counted every message.
    if answered == 0 {
        reap(c, 1, deadline)?;
    }
    c.ep.recv(&c.rx, 0, c.rx.len(), 1).map_err(e)?;
    Ok((secs, peak))
}
