//! The reliability suite's bookkeeping: profiles, a seeded random source, what a case
//! posted against what completed, and the process's resources before and after.
//!
//! Every case ends with [`Outcome::finish`], which fails the test when anything was lost,
//! leaked or waited past its bound, and appends one JSON line to the file named by
//! `RFABRIC_RELIABILITY_OUT` (what `scripts/reliability` makes its table from).
#![allow(dead_code, unreachable_pub)]

pub mod traffic;

use std::io::Write;
use std::time::{Duration, Instant};

/// How long a case runs: `short` in CI (the default), `long` on demand
/// (`RFABRIC_RELIABILITY_PROFILE=long`, or `scripts/reliability --long`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    Short,
    Long,
}

impl Profile {
    pub fn get() -> Profile {
        match std::env::var("RFABRIC_RELIABILITY_PROFILE").as_deref() {
            Ok("long") => Profile::Long,
            _ => Profile::Short,
        }
    }

    /// `short` or `long` repetitions, whichever the profile says.
    pub fn pick<T>(self, short: T, long: T) -> T {
        match self {
            Profile::Short => short,
            Profile::Long => long,
        }
    }
}

/// xorshift64*: reproducible from the seed each case prints (`RFABRIC_RELIABILITY_SEED`).
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn for_case(case: &str) -> Rng {
        let seed = std::env::var("RFABRIC_RELIABILITY_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        eprintln!("[{case}] seed {seed} (RFABRIC_RELIABILITY_SEED={seed} repeats this run)");
        Rng(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// What the process holds, read from /proc: the figures a leak would move.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub fds: usize,
    pub threads: usize,
    pub rss_kib: usize,
    /// Pinned pages (`VmPin`): what registered memory holds.
    pub pinned_kib: usize,
    pub shm_files: usize,
}

impl Resources {
    pub fn now() -> Resources {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let count = |dir: &str| std::fs::read_dir(dir).map_or(0, |d| d.count());
        Resources {
            fds: count("/proc/self/fd"),
            threads: field("Threads:"),
            rss_kib: field("VmRSS:"),
            pinned_kib: field("VmPin:"),
            shm_files: count("/dev/shm"),
        }
    }

    /// What grew between `self` (after warm-up) and `after`, beyond `rss_slack_kib` of
    /// resident memory (allocator caches): each a leak, described.
    pub fn leaks_to(&self, after: &Resources, rss_slack_kib: usize) -> Vec<String> {
        let mut v = Vec::new();
        let mut check = |what: &str, a: usize, b: usize, slack: usize| {
            if b > a + slack {
                v.push(format!("{what} {a} -> {b}"));
            }
        };
        check("fds", self.fds, after.fds, 0);
        check("threads", self.threads, after.threads, 0);
        check("pinned KiB", self.pinned_kib, after.pinned_kib, 0);
        check("/dev/shm files", self.shm_files, after.shm_files, 0);
        check("RSS KiB", self.rss_kib, after.rss_kib, rss_slack_kib);
        v
    }
}

/// A case's account: every operation posted must come back exactly once, as a success or
/// an error completion, within `bound`.
#[derive(Debug)]
pub struct Outcome {
    pub case: String,
    /// The fault injected, in words (shown in the table).
    pub fault: String,
    pub faults: u64,
    pub posted: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub bytes_verified: u64,
    /// The longest any operation waited for its completion after the fault.
    pub max_wait: Duration,
    pub bound: Duration,
    pub leaks: Vec<String>,
    /// Problems found (wrong order, wrong bytes, a missing event): each fails the case.
    pub problems: Vec<String>,
    started: Instant,
}

impl Outcome {
    pub fn new(case: &str, fault: &str, bound: Duration) -> Outcome {
        Outcome {
            case: case.into(),
            fault: fault.into(),
            faults: 0,
            posted: 0,
            succeeded: 0,
            failed: 0,
            bytes_verified: 0,
            max_wait: Duration::ZERO,
            bound,
            leaks: Vec::new(),
            problems: Vec::new(),
            started: Instant::now(),
        }
    }

    pub fn waited(&mut self, d: Duration) {
        self.max_wait = self.max_wait.max(d);
    }

    pub fn problem(&mut self, p: impl Into<String>) {
        let p = p.into();
        eprintln!("[{}] problem: {p}", self.case);
        if self.problems.len() < 20 {
            self.problems.push(p);
        }
    }

    pub fn lost(&self) -> i64 {
        self.posted as i64 - (self.succeeded + self.failed) as i64
    }

    fn json(&self) -> String {
        let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
        let list = |v: &[String]| {
            v.iter()
                .map(|s| format!("\"{}\"", esc(s)))
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "{{\"case\":\"{}\",\"fault\":\"{}\",\"faults\":{},\"posted\":{},\"succeeded\":{},\"failed\":{},\"lost\":{},\"bytes_verified\":{},\"max_wait_ms\":{:.1},\"bound_ms\":{},\"leaks\":[{}],\"problems\":[{}],\"seconds\":{:.1},\"profile\":\"{}\"}}",
            esc(&self.case),
            esc(&self.fault),
            self.faults,
            self.posted,
            self.succeeded,
            self.failed,
            self.lost(),
            self.bytes_verified,
            self.max_wait.as_secs_f64() * 1e3,
            self.bound.as_millis(),
            list(&self.leaks),
            list(&self.problems),
            self.started.elapsed().as_secs_f64(),
            match Profile::get() {
                Profile::Short => "short",
                Profile::Long => "long",
            }
        )
    }

    /// Records the outcome and fails the test on anything lost, leaked, late or wrong.
    pub fn finish(self) {
        let line = self.json();
        println!("RELIABILITY {line}");
        if let Ok(path) = std::env::var("RFABRIC_RELIABILITY_OUT") {
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
            {
                let _ = writeln!(f, "{line}");
            }
        }
        assert!(
            self.posted > 0,
            "[{}] posted nothing: the case proved nothing",
            self.case
        );
        assert_eq!(self.lost(), 0, "[{}] operations lost: {line}", self.case);
        assert!(
            self.leaks.is_empty(),
            "[{}] leaks: {:?}",
            self.case,
            self.leaks
        );
        assert!(
            self.problems.is_empty(),
            "[{}] problems: {:?}",
            self.case,
            self.problems
        );
        assert!(
            self.max_wait <= self.bound,
            "[{}] an operation waited {:?}, past the bound {:?}",
            self.case,
            self.max_wait,
            self.bound
        );
    }
}
