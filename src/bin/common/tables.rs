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

/// Percentiles by selection, not a sort: the median, then p99 and p99.9 in the part above
/// it (linear time; perftest's sort costs about 225 instructions per iteration).
pub(crate) fn lat_stats(samples: &mut [f64]) -> LatStats {
    let len = samples.len();
    if len == 0 {
        return LatStats::default();
    }
    let n = len as f64;
    let avg = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|s| (s - avg) * (s - avg)).sum::<f64>() / n;
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let max = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let rank = |p: f64| ((n * p).ceil() as usize).clamp(1, len) - 1;
    let mid = len / 2;
    let typical = *samples.select_nth_unstable_by(mid, f64::total_cmp).1;
    let (i99, i999) = (rank(0.99).max(mid), rank(0.999).max(mid));
    let upper = &mut samples[mid..];
    let p99 = *upper.select_nth_unstable_by(i99 - mid, f64::total_cmp).1;
    let upper = &mut samples[i99..];
    let p999 = *upper.select_nth_unstable_by(i999 - i99, f64::total_cmp).1;
    LatStats {
        min,
        max,
        typical,
        avg,
        stdev: var.sqrt(),
        p99,
        p999,
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

pub(crate) fn print_bw(o: &Opts, size: usize, secs: f64, peak: f64) {
    let avg = (size * o.iters) as f64 / secs / 1e6;
    let rate = o.iters as f64 / secs / 1e6;
    let peak = peak.max(avg);
    if o.json {
        println!("{{\"test\":\"{}\",\"bytes\":{size},\"iterations\":{},\"bw_peak\":{peak:.2},\"bw_avg\":{avg:.2},\"msg_rate\":{rate:.6}}}", &o.test.name()[5..], o.iters);
    } else {
        println!(
            " {:<10} {:<10}       {:<7.2}            {:<7.2}              {:<.6}",
            size, o.iters, peak, avg, rate
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selected_percentiles_match_a_sort() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [1usize, 2, 3, 10, 999, 1000, 1001, 5000] {
            let mut v: Vec<f64> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 10_000) as f64 / 7.0
                })
                .collect();
            let mut sorted = v.clone();
            sorted.sort_by(f64::total_cmp);
            let pct = |p: f64| sorted[((len as f64 * p).ceil() as usize).clamp(1, len) - 1];
            let s = lat_stats(&mut v);
            assert_eq!(
                (s.min, s.max, s.typical, s.p99, s.p999),
                (
                    sorted[0],
                    sorted[len - 1],
                    sorted[len / 2],
                    pct(0.99),
                    pct(0.999)
                ),
                "{len} samples"
            );
        }
    }
}
