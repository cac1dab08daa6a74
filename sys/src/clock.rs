//! A cheap cycle counter for timing loops, as perftest's `get_cycles`.
//!
//! Under QEMU/TCG the guest's clocksource is often the HPET, which makes every
//! `Instant::now()` an emulated MMIO read costing microseconds; the TSC is a plain
//! instruction everywhere.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The current cycle count (the TSC on x86-64; a monotonic clock elsewhere).
#[inline(always)]
pub fn cycles() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86-64 and touches no memory.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Cycles per microsecond, measured once against the system clock over 20 ms.
pub fn cycles_per_us() -> f64 {
    static RATE: OnceLock<f64> = OnceLock::new();
    *RATE.get_or_init(|| {
        let (t0, c0) = (Instant::now(), cycles());
        std::thread::sleep(Duration::from_millis(20));
        let (dt, dc) = (t0.elapsed(), cycles().wrapping_sub(c0));
        (dc as f64 / (dt.as_secs_f64() * 1e6)).max(1e-3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_advance_and_calibrate_to_a_plausible_rate() {
        let a = cycles();
        let b = cycles();
        assert!(b >= a);
        let r = cycles_per_us();
        assert!((1.0..100_000.0).contains(&r), "{r} cycles per microsecond");
    }
}
