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
        Test::SendLat => println!(
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
        ),
        Test::SendBw => println!(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"),
    }
}

pub(crate) struct LatStats {
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) typical: f64,
    pub(crate) avg: f64,
    pub(crate) stdev: f64,
    pub p99: f64,
    pub p999: f64,
}

pub(crate) fn lat_stats(samples: &mut [f64]) -> LatStats {
    samples.sort_by(|a, b| a.total_cmp(b));
    let n = samples.len().max(1) as f64;
    let avg = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|s| (s - avg) * (s - avg)).sum::<f64>() / n;
    let pct = |p: f64| {
        samples[(((samples.len() as f64) * p).ceil() as usize).clamp(1, samples.len()) - 1]
    };
    LatStats {
        min: samples[0],
        max: samples[samples.len() - 1],
        typical: samples[samples.len() / 2],
        avg,
        stdev: var.sqrt(),
        p99: pct(0.99),
        p999: pct(0.999),
    }
}

pub(crate) fn print_lat(o: &Opts, size: usize, s: &LatStats) {
    if o.json {
        println!(
            "{{\"test\":\"send_lat\",\"bytes\":{size},\"iterations\":{},\"t_min\":{:.2},\"t_max\":{:.2},\"t_typical\":{:.2},\"t_avg\":{:.2},\"t_stdev\":{:.2},\"p99\":{:.2},\"p999\":{:.2}}}",
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
        println!("{{\"test\":\"send_bw\",\"bytes\":{size},\"iterations\":{},\"bw_peak\":{peak:.2},\"bw_avg\":{avg:.2},\"msg_rate\":{rate:.6}}}", o.iters);
    } else {
        println!(
            " {:<10} {:<10}       {:<7.2}            {:<7.2}              {:<.6}",
            size, o.iters, peak, avg, rate
        );
    }
}
