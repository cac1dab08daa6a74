//! Device paths, on a connected RC pair in one process: a CQ read that finds nothing, one
//! that finds one completion, one that takes a batch of 16, and posting a send and a
//! receive. Each timed part is the call alone: the completions it reads are already in the
//! CQ (posted and left to arrive untimed), and what a post leaves behind is drained untimed.
//!
//! Needs an RDMA device: `scripts/bench-device` runs it in the SoftRoCE VM. Elsewhere it
//! says so and measures nothing (with `RFABRIC_REQUIRE_DEVICE=1` that is an error).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use rfabric::core::cq::CqEntry;
use rfabric::verbs::*;
use rfabric::*;

/// Operations per untimed refill: within the default send and receive queue depths.
const CHUNK: u64 = 64;

struct Bed {
    pair: common::Pair,
    tx: MemoryRegion,
    rx: MemoryRegion,
}

fn bed() -> Option<Bed> {
    let info = common::device_info()?;
    let pair = common::connect_pair(&info);
    let tx = MemoryRegion::alloc(&pair.domain, 64, Flags::SEND).unwrap();
    let rx = MemoryRegion::alloc(&pair.domain, 64 * CHUNK as usize, Flags::RECV).unwrap();
    Some(Bed { pair, tx, rx })
}

impl Bed {
    fn post_recvs(&self, n: u64) {
        for i in 0..n {
            self.pair
                .server
                .recv(&self.rx, (i as usize % CHUNK as usize) * 64, 64, i)
                .unwrap();
        }
    }

    fn post_sends(&self, n: u64) {
        for i in 0..n {
            self.pair.client.send(&self.tx, 0, 8, i).unwrap();
        }
    }

    /// Reads `n` completions from `cq`, untimed (10 s at most).
    fn drain(cq: &CompletionQueue, mut n: u64) {
        let t = Instant::now();
        let mut out = [CqEntry::default(); 16];
        while n > 0 {
            match cq.read(&mut out[..(n.min(16) as usize)]) {
                Ok(k) => n -= k as u64,
                Err(e) if e.is_again() => {}
                Err(e) => panic!("{e}: {:?}", cq.readerr()),
            }
            assert!(t.elapsed() < Duration::from_secs(10), "completions stopped");
        }
    }

    /// `n` sends to `n` posted receives, with every completion in the CQs: the server's
    /// read untimed, the client's sends left for the caller to read (given time to arrive).
    fn fill(&self, n: u64) {
        self.post_recvs(n);
        self.post_sends(n);
        Self::drain(&self.pair.server_cq, n);
        // The receives are in: the senders' acknowledgements follow within a round trip.
        // Waited for on the CPU: a sleep would leave the timed read to a cold cache.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1) {
            std::hint::spin_loop();
        }
    }
}

/// `batch` completions per timed read, `iters` in all, refilled untimed `CHUNK` at a time.
fn timed_reads(b: &Bed, iters: u64, batch: usize) -> Duration {
    let mut out = [CqEntry::default(); 16];
    let mut spent = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let reads = left.min(CHUNK / batch as u64).max(1);
        b.fill(reads * batch as u64);
        for _ in 0..reads {
            let t = Instant::now();
            let r = b.pair.client_cq.read(&mut out[..batch]);
            spent += t.elapsed();
            match r {
                Ok(n) if n == batch => {}
                // Not all there yet (a slow acknowledgement): take the rest untimed.
                Ok(n) => Bed::drain(&b.pair.client_cq, (batch - n) as u64),
                Err(e) if e.is_again() => Bed::drain(&b.pair.client_cq, batch as u64),
                Err(e) => panic!("{e}"),
            }
        }
        left -= reads;
    }
    spent
}

/// `iters` sends (`sends`) or receives, timed `CHUNK` at a time; the other side's posts
/// that match them and the completions they leave are untimed.
fn timed_posts(b: &Bed, iters: u64, sends: bool) -> Duration {
    let mut spent = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        if sends {
            b.post_recvs(n);
        }
        let t = Instant::now();
        if sends {
            b.post_sends(n);
        } else {
            b.post_recvs(n);
        }
        spent += t.elapsed();
        if !sends {
            b.post_sends(n);
        }
        Bed::drain(&b.pair.server_cq, n);
        Bed::drain(&b.pair.client_cq, n);
        left -= n;
    }
    spent
}

fn device_paths(c: &mut Criterion) {
    let Some(b) = bed() else {
        eprintln!("no RDMA device: device_paths measures nothing here (scripts/bench-device runs it in the SoftRoCE VM)");
        return;
    };
    let mut g = c.benchmark_group("device");
    // The timed parts are a small share of each run (refills sleep and drain untimed):
    // short measurement windows keep a run within seconds under TCG.
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(20))
        .measurement_time(Duration::from_millis(200));
    g.bench_function("cq read, empty", |bn| {
        let mut out = [CqEntry::default(); 1];
        bn.iter(|| black_box(b.pair.client_cq.read(&mut out).is_err()))
    });
    g.bench_function("cq read, one completion", |bn| {
        bn.iter_custom(|iters| timed_reads(&b, iters, 1))
    });
    g.bench_function("cq read, batch of 16", |bn| {
        bn.iter_custom(|iters| timed_reads(&b, iters, 16))
    });
    g.bench_function("post send (8 B, inline)", |bn| {
        bn.iter_custom(|iters| timed_posts(&b, iters, true))
    });
    g.bench_function("post receive", |bn| {
        bn.iter_custom(|iters| timed_posts(&b, iters, false))
    });
    g.finish();
}

criterion_group!(benches, device_paths);
criterion_main!(benches);
