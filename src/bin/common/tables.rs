//! Perftest-style output: the banner, latency statistics and the per-size table rows.

use super::options::{Opts, Test};
use super::setup::{Conn, Ep};

pub(crate) fn banner(o: &Opts, c: &Conn) {
    if o.json {
        return;
    }
    let line = "-".repeat(87);
    let title = match o.test {
        Test::SendLat => "Send Latency Test",
        Test::SendBw => "Send BW Test",
        Test::WriteLat => "RDMA_Write Latency Test",
        Test::ReadLat => "RDMA_Read Latency Test",
        Test::WriteBw => "RDMA_Write BW Test",
        Test::ReadBw => "RDMA_Read BW Test",
    };
    println!("{line}");
    let (ep_type, transport) = match c.ep {
        Ep::Msg(_) => ("FI_EP_MSG", "RC over rdma_cm, manual progress"),
        Ep::Dgram { .. } => ("FI_EP_DGRAM", "UD, manual progress"),
        Ep::Rdm { tag: Some(_), .. } => (
            "FI_EP_RDM, tagged",
            "RC connected on first send, eager copies, manual progress",
        ),
        Ep::Rdm { .. } => (
            "FI_EP_RDM",
            "RC connected on first send, eager copies, manual progress",
        ),
    };
    let (local, remote) = c.ep.names();
    println!("                    {title} (rfabric rverbs, {ep_type})");
    println!(" Device         : {}", c.info.domain_attr.name);
    println!(" Transport type : {transport}");
    println!(" TX depth       : {}", o.tx_depth);
    // As perftest, for sends only: what the endpoint was opened with (RDM: bounce buffers).
    if matches!(o.test, Test::SendLat | Test::SendBw) {
        println!(" RX depth       : {}", c.info.rx_attr.size);
    }
    println!(" Inline size    : {}", c.ep.inject_size());
    println!(" Local address  : {local}");
    println!(" Remote address : {remote}");
    println!("{line}");
    match o.test {
        Test::SendLat | Test::WriteLat | Test::ReadLat => println!(
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
        ),
        Test::SendBw | Test::WriteBw | Test::ReadBw => println!(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"),
    }
}

#[derive(Debug, Default, PartialEq)]
pub(crate) struct LatStats {
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) typical: f64,
    pub(crate) avg: f64,
    pub(crate) stdev: f64,
    pub p99: f64,
    pub p999: f64,
}

/// Latency samples as TSC cycles, converted to microseconds once, for the table: the loop
/// stores a subtraction per sample, and the statistics compare integers.
pub(crate) struct Samples {
    pub(crate) cycles: Vec<u64>,
    /// Cycles per reported microsecond: the TSC rate, times 2 for round trips (one-way
    /// latency is half of each).
    per_us: f64,
}

impl Samples {
    /// Room for `n` samples, each reported divided by `div` (2 for round trips).
    pub(crate) fn with_capacity(n: usize, div: f64) -> Self {
        Samples {
            cycles: Vec::with_capacity(n),
            per_us: rfabric_sys::clock::cycles_per_us() * div,
        }
    }
}

/// Percentiles by selection, not a sort: the median, then p99 and p99.9 in the part above
/// it (linear time; perftest's sort costs about 225 instructions per iteration).
pub(crate) fn lat_stats(s: &mut Samples) -> LatStats {
    let samples = &mut s.cycles[..];
    let len = samples.len();
    if len == 0 {
        return LatStats::default();
    }
    let us = |c: u64| c as f64 / s.per_us;
    let n = len as f64;
    // One pass: the sum (u128: no overflow), the sum of squares, the extremes.
    let (mut sum, mut sq, mut min, mut max) = (0u128, 0f64, u64::MAX, 0u64);
    for &c in samples.iter() {
        sum += u128::from(c);
        sq += (c as f64) * (c as f64);
        min = min.min(c);
        max = max.max(c);
    }
    let mean = sum as f64 / n;
    let var = (sq / n - mean * mean).max(0.0);
    let rank = |p: f64| ((n * p).ceil() as usize).clamp(1, len) - 1;
    let mid = len / 2;
    let typical = *samples.select_nth_unstable(mid).1;
    let (i99, i999) = (rank(0.99).max(mid), rank(0.999).max(mid));
    let p99 = *samples[mid..].select_nth_unstable(i99 - mid).1;
    let p999 = *samples[i99..].select_nth_unstable(i999 - i99).1;
    LatStats {
        min: us(min),
        max: us(max),
        typical: us(typical),
        avg: mean / s.per_us,
        stdev: var.sqrt() / s.per_us,
        p99: us(p99),
        p999: us(p999),
    }
}

pub(crate) fn print_lat(o: &Opts, size: usize, s: &LatStats) {
    if o.json {
        println!(
            "{{\"test\":\"{}\",\"bytes\":{size},\"iterations\":{},\"t_min\":{:.2},\"t_max\":{:.2},\"t_typical\":{:.2},\"t_avg\":{:.2},\"t_stdev\":{:.2},\"p99\":{:.2},\"p999\":{:.2}}}",
            &o.test.name()[5..],
            o.iters, s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
        );
    } else {
        println!(
            " {:<6} {:<10}       {:<7.2}        {:<7.2}      {:<7.2}            {:<7.2}        {:<7.2}         {:<7.2}                {:<7.2}",
            size, o.iters, s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999
        );
    }
}

/// perftest's "MB" (`print_report_bw`, `format_factor` 0x100000): its MB/sec are MiB/s.
const MB: f64 = 1048576.0;

/// A bandwidth row: `peak` in bytes per microsecond (the best window's), the average and
/// the peak reported in perftest's MB/sec, the message rate in millions per second.
pub(crate) fn print_bw(o: &Opts, size: usize, secs: f64, peak: f64) {
    let (peak, avg, rate) = bw_figures(size, o.iters, secs, peak);
    if o.json {
        println!("{{\"test\":\"{}\",\"bytes\":{size},\"iterations\":{},\"bw_peak\":{peak:.2},\"bw_avg\":{avg:.2},\"msg_rate\":{rate:.6}}}", &o.test.name()[5..], o.iters);
    } else {
        println!(
            " {:<10} {:<10}       {:<7.2}            {:<7.2}              {:<.6}",
            size, o.iters, peak, avg, rate
        );
    }
}

/// (peak MB/sec, average MB/sec, Mpps) of `iters` messages of `size` bytes in `secs`, the
/// best window having moved `peak` bytes per microsecond.
fn bw_figures(size: usize, iters: usize, secs: f64, peak: f64) -> (f64, f64, f64) {
    let avg = (size * iters) as f64 / secs / MB;
    let rate = iters as f64 / secs / 1e6;
    ((peak * 1e6 / MB).max(avg), avg, rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_is_in_perftest_megabytes() {
        // 1000 messages of 1 MiB in 2 s: 500 perftest MB/sec (MiB/s), 0.0005 Mpps.
        let (peak, avg, rate) = bw_figures(1 << 20, 1000, 2.0, 1.048576 * 600.0);
        assert_eq!((avg, rate), (500.0, 0.0005));
        assert!((peak - 600.0).abs() < 1e-9, "{peak}");
    }

    #[test]
    fn selected_percentiles_match_a_sort() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [1usize, 2, 3, 10, 999, 1000, 1001, 5000] {
            let v: Vec<u64> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % 10_000
                })
                .collect();
            let mut sorted = v.clone();
            sorted.sort();
            let per_us = 7.0;
            let pct = |p: f64| sorted[((len as f64 * p).ceil() as usize).clamp(1, len) - 1];
            let mut samples = Samples {
                cycles: v.clone(),
                per_us,
            };
            let s = lat_stats(&mut samples);
            let us = |c: u64| c as f64 / per_us;
            assert_eq!(
                (s.min, s.max, s.typical, s.p99, s.p999),
                (
                    us(sorted[0]),
                    us(sorted[len - 1]),
                    us(sorted[len / 2]),
                    us(pct(0.99)),
                    us(pct(0.999))
                ),
                "{len} samples"
            );
            // Mean and standard deviation as the two-pass formulas give them.
            let m = v.iter().map(|&c| us(c)).sum::<f64>() / len as f64;
            let sd = (v.iter().map(|&c| (us(c) - m).powi(2)).sum::<f64>() / len as f64).sqrt();
            assert!(
                (s.avg - m).abs() < 1e-9 * m.max(1.0),
                "{len}: mean {} vs {m}",
                s.avg
            );
            assert!(
                (s.stdev - sd).abs() < 1e-6 * sd.max(1.0),
                "{len}: stdev {} vs {sd}",
                s.stdev
            );
        }
    }
}
