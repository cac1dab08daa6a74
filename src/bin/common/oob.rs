//! The out-of-band exchange: the TCP control connection and the parameters sent over it.

use std::io::BufRead;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::options::Opts;

/// The client's parameters, sent to the server over the TCP control connection.
pub(super) fn encode_params(o: &Opts) -> String {
    format!(
        "rfab1 test={} ud={} rdm={} tagged={} all={} size={} iters={} depth={} rx={} inline={}\n",
        o.test as u8,
        o.ud as u8,
        o.rdm as u8,
        o.tagged as u8,
        o.all as u8,
        o.size,
        o.iters,
        o.tx_depth,
        o.rx_depth,
        o.inline.map_or(-1, |i| i as i64)
    )
}

pub(super) fn decode_params(o: &mut Opts, line: &str) -> Result<(), String> {
    let mut f = line.split_whitespace();
    if f.next() != Some("rfab1") {
        return Err(format!(
            "the peer is not an rfabric tool of this version (it sent {line:?})"
        ));
    }
    for kv in f {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("bad parameter {kv:?}"))?;
        let n: i64 = v.parse().map_err(|_| format!("bad parameter {kv:?}"))?;
        match k {
            "test" if n != o.test as i64 => {
                return Err(
                    "the client runs a different test: start both sides with the same tool".into(),
                )
            }
            "test" => {}
            "ud" => o.ud = n != 0,
            "rdm" => o.rdm = n != 0,
            "tagged" => o.tagged = n != 0,
            "all" => o.all = n != 0,
            "size" => o.size = n as usize,
            "iters" => o.iters = n as usize,
            "depth" => o.tx_depth = n as usize,
            "rx" => o.rx_depth = n as usize,
            "inline" => o.inline = (n >= 0).then_some(n as usize),
            _ => return Err(format!("unknown parameter {k:?}")),
        }
    }
    Ok(())
}

/// The server's side of the control connection: waits (saying so) for one client.
pub(super) fn oob_accept(
    port: u16,
    deadline: Instant,
    o: &Opts,
    dev: &str,
) -> Result<TcpStream, String> {
    let l = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| format!("cannot listen on TCP port {port}: {e}"))?;
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    eprintln!(
        "waiting for a client on port {port} (device {dev}, giving up after {} s)...",
        o.timeout.as_secs()
    );
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(o.timeout))
                    .map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(format!(
                        "no client connected within {} s",
                        o.timeout.as_secs()
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The client's side: connects to the server's control port, retrying briefly while the
/// server starts, and fails with the cause rather than hang.
pub(super) fn oob_connect(server: &str, port: u16, o: &Opts) -> Result<TcpStream, String> {
    let addrs: Vec<_> = (server, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {server}: {e}"))?
        .collect();
    let give_up = Instant::now() + o.timeout.min(Duration::from_secs(5));
    loop {
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                Ok(s) => {
                    s.set_read_timeout(Some(o.timeout))
                        .map_err(|e| e.to_string())?;
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        if Instant::now() > give_up {
            let e = last.map_or("no address".to_string(), |e| e.to_string());
            return Err(format!(
                "no server at {server}:{port} ({e}): start the server first"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub(super) fn read_line(s: &mut impl BufRead, what: &str) -> Result<String, String> {
    let mut line = String::new();
    match s.read_line(&mut line) {
        Ok(0) => Err(format!(
            "the peer closed the control connection before {what}"
        )),
        Ok(_) => Ok(line.trim_end().to_string()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(format!("timed out waiting for {what}"))
        }
        Err(e) => Err(format!("control connection: {e}")),
    }
}
