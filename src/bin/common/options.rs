//! Command-line options: the test a tool runs, its options, the usage text and the parser.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Test {
    SendLat,
    SendBw,
    /// RDMA write ping-pong: each side polls its buffer's last byte (perftest's write_lat).
    WriteLat,
    /// One RDMA read at a time, timed to its completion (perftest's read_lat).
    ReadLat,
    /// RDMA writes in flight, counted by their completions (perftest's write_bw).
    WriteBw,
    /// RDMA reads in flight (perftest's read_bw).
    ReadBw,
}

impl Test {
    /// Latency tests: small default size, a table of latencies.
    pub(crate) fn is_lat(self) -> bool {
        matches!(self, Test::SendLat | Test::WriteLat | Test::ReadLat)
    }

    /// One-sided tests: RDMA writes or reads into the peer's buffer, over RC only.
    pub(crate) fn is_rma(self) -> bool {
        !matches!(self, Test::SendLat | Test::SendBw)
    }

    /// The tool's name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Test::SendLat => "rfab_send_lat",
            Test::SendBw => "rfab_send_bw",
            Test::WriteLat => "rfab_write_lat",
            Test::ReadLat => "rfab_read_lat",
            Test::WriteBw => "rfab_write_bw",
            Test::ReadBw => "rfab_read_bw",
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Opts {
    pub(crate) test: Test,
    pub(crate) server: Option<String>,
    pub(crate) port: u16,
    pub(crate) device: Option<String>,
    pub(crate) size: usize,
    pub(crate) all: bool,
    pub(crate) iters: usize,
    pub(crate) tx_depth: usize,
    /// `-r`: receive queue depth: receives posted ahead (MSG, DGRAM), bounce buffers (RDM).
    pub(crate) rx_depth: usize,
    /// Largest send carried inline (`-I`); `None` leaves the provider's inject size.
    pub(crate) inline: Option<usize>,
    pub(crate) json: bool,
    pub(crate) timeout: Duration,
    /// `-c UD`: datagrams (`FI_EP_DGRAM` on UD QPs) instead of RC.
    pub(crate) ud: bool,
    /// `-e rdm`: a reliable connectionless endpoint (`FI_EP_RDM`) instead of a connected one.
    pub(crate) rdm: bool,
    /// `--tagged`: tagged messages (`fi_tsend`/`fi_trecv`), RDM only.
    pub(crate) tagged: bool,
}

pub(super) const MAX_ALL: usize = 8 << 20;

pub(crate) fn usage(test: Test) -> String {
    let name = test.name();
    format!(
        "usage: {name} [options]            (server)\n       {name} [options] SERVER     (client)\n\
         \x20 -d, --ib-dev DEV     device (domain) to use, e.g. rxe0\n\
         \x20 -p, --port PORT      rdma_cm port (default 18515)\n\
         \x20 -s, --size BYTES     message size (default {})\n\
         \x20 -a, --all            every power of two from 2 B to 8 MiB (capped by max_msg_size)\n\
         \x20 -n, --iters N        iterations per size (default {})\n\
         \x20 -t, --tx-depth N     sends in flight for bandwidth (default 128)\n\
         \x20 -r, --rx-depth N     receive queue size: receives posted ahead, or RDM's bounce buffers (default 512)\n\
         \x20 -I, --inline_size N  largest send carried inline (default: the device's inject size)\n\
         \x20 -x, --gid-index N    accepted for perftest compatibility (rdma_cm picks the GID)\n\
         \x20 -c, --connection T   RC (default) or UD (latency only: datagrams up to the MTU)\n\
         \x20 -e, --endpoint T     msg (default: FI_EP_MSG over RC) or rdm (FI_EP_RDM)\n\
         \x20     --tagged         tagged messages (with -e rdm)\n\
         \x20 -T, --timeout SEC    give up waiting for the peer after SEC seconds (default 60)\n\
         \x20     --json           one JSON object per size instead of the table\n",
        if test.is_lat() { 2 } else { 65536 },
        if test.is_lat() { 1000 } else { 5000 }
    )
}

pub(crate) fn parse(test: Test, args: impl Iterator<Item = String>) -> Result<Opts, String> {
    let mut o = Opts {
        test,
        server: None,
        port: 18515,
        device: None,
        size: if test.is_lat() { 2 } else { 65536 },
        all: false,
        iters: if test.is_lat() { 1000 } else { 5000 },
        tx_depth: 128,
        rx_depth: 512,
        inline: None,
        json: false,
        timeout: Duration::from_secs(60),
        ud: false,
        rdm: false,
        tagged: false,
    };
    let mut args = args.peekable();
    fn num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse()
            .map_err(|_| format!("{flag}: {v:?} is not a valid number"))
    }
    while let Some(a) = args.next() {
        match a.as_str() {
            "-d" | "--ib-dev" => o.device = Some(args.next().ok_or("-d needs a device name")?),
            "-p" | "--port" => o.port = num(&a, args.next())?,
            "-s" | "--size" => o.size = num(&a, args.next())?,
            "-a" | "--all" => o.all = true,
            "-n" | "--iters" => o.iters = num(&a, args.next())?,
            "-t" | "--tx-depth" => o.tx_depth = num(&a, args.next())?,
            "-r" | "--rx-depth" => o.rx_depth = num(&a, args.next())?,
            "-I" | "--inline_size" => o.inline = Some(num(&a, args.next())?),
            // rdma_cm chooses the GID that routes to the peer; accepted for perftest's sake.
            "-x" | "--gid-index" => {
                let _: u32 = num(&a, args.next())?;
            }
            "-T" | "--timeout" => o.timeout = Duration::from_secs(num(&a, args.next())?),
            "--json" => o.json = true,
            "-c" | "--connection" => {
                o.ud = match args.next().as_deref() {
                    Some("RC") => false,
                    Some("UD") => true,
                    other => return Err(format!("-c {other:?}: RC or UD")),
                }
            }
            "-e" | "--endpoint" => {
                o.rdm = match args.next().map(|s| s.to_ascii_lowercase()).as_deref() {
                    Some("msg") => false,
                    Some("rdm") => true,
                    other => return Err(format!("-e {other:?}: msg or rdm")),
                }
            }
            "--tagged" => o.tagged = true,
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s => {
                if o.server.replace(s.to_string()).is_some() {
                    return Err("only one server address may be given".into());
                }
            }
        }
    }
    if o.ud && test == Test::SendBw {
        return Err(
            "-c UD: datagrams may be dropped, which a bandwidth count cannot tell from slowness; use rfab_send_lat -c UD"
                .into(),
        );
    }
    if test.is_rma() && (o.ud || o.rdm) {
        return Err("RDMA writes and reads run over connected endpoints (RC, -e msg) only".into());
    }
    if o.rdm && o.ud {
        return Err("-e rdm and -c UD: choose one endpoint type".into());
    }
    if o.tagged && !o.rdm {
        return Err("--tagged needs -e rdm (MSG endpoints have no tagged messages)".into());
    }
    if o.iters == 0 || o.tx_depth == 0 || o.tx_depth > 4096 {
        return Err("iterations must be > 0 and the tx depth between 1 and 4096".into());
    }
    if o.rx_depth == 0 || o.rx_depth > 4096 {
        return Err("the rx depth must be between 1 and 4096".into());
    }
    Ok(o)
}
