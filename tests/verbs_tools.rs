//! Device tests of the perftest-style tools: two processes, a server and a client.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn addr() -> Option<String> {
    common::device_info().map(|i| i.src_addr.expect("device address").ip().to_string())
}

/// Runs a server and a client of `tool` on `port`; returns the client's stdout.
fn run_pair(tool: &str, port: u16, args: &[&str], server_ip: &str) -> String {
    run_pair_env(tool, port, args, server_ip, &[])
}

/// [`run_pair`] with `envs` set in both processes.
fn run_pair_env(
    tool: &str,
    port: u16,
    args: &[&str],
    server_ip: &str,
    envs: &[(&str, &str)],
) -> String {
    run_pair_outputs(tool, port, args, server_ip, envs).0
}

/// [`run_pair_env`], returning the client's stdout and stderr and the server's stderr.
fn run_pair_outputs(
    tool: &str,
    port: u16,
    args: &[&str],
    server_ip: &str,
    envs: &[(&str, &str)],
) -> (String, String, String) {
    let port_s = port.to_string();
    // A server of a one-sided test hears nothing from its client while a size runs (8 MiB
    // reads take seconds under TCG): a generous limit, reached only on failure.
    let server = Command::new(tool)
        .envs(envs.iter().copied())
        .args(["-p", &port_s, "-T", "120"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let client = Command::new(tool)
        .envs(envs.iter().copied())
        .args(["-p", &port_s, "-T", "120"])
        .args(args)
        .arg(server_ip)
        .output()
        .unwrap();
    let server_out = server.wait_with_output().unwrap();
    let serr = String::from_utf8_lossy(&server_out.stderr).to_string();
    assert!(
        client.status.success(),
        "client failed: {}\nserver said: {serr}",
        String::from_utf8_lossy(&client.stderr)
    );
    assert!(server_out.status.success(), "server failed: {serr}");
    assert!(
        serr.contains("waiting for a client"),
        "the server says it is waiting: {serr}"
    );
    let cerr = String::from_utf8_lossy(&client.stderr).to_string();
    (String::from_utf8(client.stdout).unwrap(), cerr, serr)
}

fn json_rows(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with('{'))
        .map(str::to_string)
        .collect()
}

#[test]
fn send_lat_runs_between_two_processes_and_reports_every_size() {
    let Some(ip) = addr() else { return };
    let out = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18601,
        &["-s", "64", "-n", "200", "--json"],
        &ip,
    );
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 1, "{out}");
    assert!(
        rows[0].contains("\"bytes\":64") && rows[0].contains("\"iterations\":200"),
        "{out}"
    );
    let table = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18602,
        &["-s", "8", "-n", "100"],
        &ip,
    );
    assert!(table.contains("t_typical[usec]"), "{table}");
    assert!(
        table.lines().any(|l| l.trim_start().starts_with("8 ")),
        "{table}"
    );
}

/// `RFAB_PHASES` splits each side's round trip into the send call, the read that finds the
/// peer's message, the empty reads and the receive post (stderr); without it, nothing.
#[test]
fn send_lat_phases_split_each_sides_round_trip() {
    let Some(ip) = addr() else { return };
    let tool = env!("CARGO_BIN_EXE_rfab_send_lat");
    let args = ["-e", "rdm", "--tagged", "-s", "64", "-n", "200", "--json"];
    let shm_off = ("FI_RVERBS_RDM_SHM", "0");
    let (out, cerr, serr) =
        run_pair_outputs(tool, 18608, &args, &ip, &[shm_off, ("RFAB_PHASES", "1")]);
    assert_eq!(json_rows(&out).len(), 1, "{out}");
    for (side, err) in [("client", &cerr), ("server", &serr)] {
        let line = err
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "phases ({side}, 64 B, per round trip): send call "
                ))
            })
            .unwrap_or_else(|| panic!("no {side} phases line: {err}"));
        // The size and five figures; the send call and the finding read took some time.
        let nums: Vec<f64> = line
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter_map(|w| w.parse().ok())
            .collect();
        assert_eq!(nums.len(), 6, "{line}");
        assert!(nums[1] > 0.0 && nums[2] > 0.0, "{line}");
    }
    let (_, cerr, serr) = run_pair_outputs(tool, 18609, &args, &ip, &[shm_off]);
    assert!(
        !cerr.contains("phases") && !serr.contains("phases"),
        "{cerr} {serr}"
    );
}

#[test]
fn write_lat_runs_between_two_processes_over_every_size_to_8_mib() {
    let Some(ip) = addr() else { return };
    let out = run_pair(
        env!("CARGO_BIN_EXE_rfab_write_lat"),
        18611,
        &["-a", "-n", "20", "--json"],
        &ip,
    );
    let rows = json_rows(&out);
    // 2 B to 8 MiB: every power of two, each round trip seen through the last byte.
    assert_eq!(rows.len(), 23, "{out}");
    assert!(
        rows[0].contains("\"bytes\":2") && rows[22].contains("\"bytes\":8388608"),
        "{out}"
    );
    let table = run_pair(
        env!("CARGO_BIN_EXE_rfab_write_lat"),
        18612,
        &["-s", "64", "-n", "300"],
        &ip,
    );
    assert!(table.contains("RDMA_Write Latency Test"), "{table}");
    assert!(
        table.lines().any(|l| l.trim_start().starts_with("64 ")),
        "{table}"
    );
    let refused = Command::new(env!("CARGO_BIN_EXE_rfab_write_lat"))
        .args(["-e", "rdm"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("RC, -e msg"));
}

/// A smaller `FI_RVERBS_RDM_BUFFER_SIZE` alone works: the segmented size's default
/// follows it (64 buffers' worth), where it used to stay 64 KiB and refuse to open. Sizes
/// on both sides of each protocol's bound at 1 KiB buffers: eager, segmented, rendezvous.
#[test]
fn rdm_with_small_bounce_buffers_opens_and_runs_every_protocol() {
    let Some(ip) = addr() else { return };
    let small = [
        ("FI_RVERBS_RDM_SHM", "0"),
        ("FI_RVERBS_RDM_BUFFER_SIZE", "1024"),
    ];
    for (i, size) in ["992", "993", "63488", "63489"].iter().enumerate() {
        let out = run_pair_env(
            env!("CARGO_BIN_EXE_rfab_send_lat"),
            18620 + i as u16,
            &["-e", "rdm", "--tagged", "-s", size, "-n", "20", "--json"],
            &ip,
            &small,
        );
        let rows = json_rows(&out);
        assert_eq!(rows.len(), 1, "{size}: {out}");
        assert!(rows[0].contains(&format!("\"bytes\":{size}")), "{out}");
    }
    // Set explicitly past 64 buffers, it is refused with the reason (each side opens its
    // endpoint once the control connection is up).
    let bad = |host: Option<&str>| {
        Command::new(env!("CARGO_BIN_EXE_rfab_send_lat"))
            .envs(small)
            .env("FI_RVERBS_RDM_SEGMENTED_MAX", "65536")
            .args([
                "-e", "rdm", "-p", "18624", "-T", "10", "-s", "64", "-n", "5",
            ])
            .args(host)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let server = bad(None);
    std::thread::sleep(Duration::from_millis(500));
    let client = bad(Some(&ip)).wait_with_output().unwrap();
    let server = server.wait_with_output().unwrap();
    assert!(!client.status.success() && !server.status.success());
    let err = String::from_utf8_lossy(&server.stderr);
    assert!(
        err.contains("FI_RVERBS_RDM_SEGMENTED_MAX=65536: at most 64 bounce buffers (63488 bytes)"),
        "{err}"
    );
}

/// `-r` (perftest's receive depth) sets an RDM endpoint's bounce buffers: 16 of them carry
/// 200 round trips (each buffer posted again as its message is taken), and the table
/// says so, as perftest's header does. Over MSG it is the receives posted ahead.
#[test]
fn rx_depth_sets_the_receives_posted_ahead_and_the_rdm_bounce_buffers() {
    let Some(ip) = addr() else { return };
    let out = run_pair_env(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18626,
        &["-e", "rdm", "--tagged", "-r", "16", "-s", "64", "-n", "200"],
        &ip,
        &[("FI_RVERBS_RDM_SHM", "0")],
    );
    assert!(out.contains(" RX depth       : 16\n"), "{out}");
    let row = out
        .lines()
        .find(|l| l.split_whitespace().take(2).eq(["64", "200"]))
        .unwrap_or_else(|| panic!("no row for 64 bytes: {out}"));
    assert!(row.split_whitespace().count() >= 7, "{row}");
    // Over MSG both sides post that many receives ahead, the server the client's number:
    // more than its own default, which its queue pair must hold.
    let out = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18627,
        &["-r", "1024", "-s", "64", "-n", "50"],
        &ip,
    );
    assert!(out.contains(" RX depth       : 1024\n"), "{out}");
}

/// The `key` field of a JSON row.
fn field(row: &str, key: &str) -> f64 {
    let v = row
        .split(&format!("\"{key}\":"))
        .nth(1)
        .unwrap_or_else(|| panic!("{key} in {row}"));
    v.split([',', '}']).next().unwrap().parse().unwrap()
}

#[test]
fn read_lat_write_bw_and_read_bw_run_between_two_processes_over_every_size() {
    let Some(ip) = addr() else { return };
    for (tool, port, test) in [
        (env!("CARGO_BIN_EXE_rfab_read_lat"), 18613, "read_lat"),
        (env!("CARGO_BIN_EXE_rfab_write_bw"), 18614, "write_bw"),
        (env!("CARGO_BIN_EXE_rfab_read_bw"), 18615, "read_bw"),
    ] {
        let out = run_pair(tool, port, &["-a", "-n", "20", "--json"], &ip);
        let rows = json_rows(&out);
        assert_eq!(rows.len(), 23, "{test}: 2 B to 8 MiB\n{out}");
        for (k, row) in rows.iter().enumerate() {
            assert!(row.contains(&format!("\"test\":\"{test}\"")), "{row}");
            assert_eq!(field(row, "bytes"), (2u64 << k) as f64, "{row}");
            // (bw_avg has two decimals: 20 messages of 2 B can read 0.00 MB/s.)
            let v = if test == "read_lat" {
                field(row, "t_typical")
            } else {
                field(row, "msg_rate")
            };
            assert!(v > 0.0, "{row}");
        }
    }
    let table = run_pair(
        env!("CARGO_BIN_EXE_rfab_read_bw"),
        18616,
        &["-s", "4096", "-n", "500"],
        &ip,
    );
    assert!(table.contains("RDMA_Read BW Test"), "{table}");
    assert!(
        table.lines().any(|l| l.trim_start().starts_with("4096 ")),
        "{table}"
    );
}

#[test]
fn send_bw_runs_between_two_processes() {
    let Some(ip) = addr() else { return };
    let out = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_bw"),
        18603,
        &["-s", "4096", "-n", "500", "--json"],
        &ip,
    );
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 1, "{out}");
    let avg: f64 = rows[0]
        .split("\"bw_avg\":")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(avg > 0.0, "{out}");
}

#[test]
fn client_without_a_server_fails_with_a_clear_error_not_a_hang() {
    let Some(ip) = addr() else { return };
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_rfab_send_lat"))
        .args(["-p", "18699", "-T", "10", &ip])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("error:") && (err.contains("refused") || err.contains("timed out")),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn bad_arguments_print_usage_and_exit_2() {
    for args in [
        &["-s", "lots"][..],
        &["--frobnicate"][..],
        &["-n", "0"][..],
        &["-r", "0"][..],
        &["-r", "4097"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_rfab_send_bw"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("usage:"),
            "{args:?}"
        );
    }
}

#[test]
fn a_client_of_another_test_is_refused_with_the_servers_reason() {
    let Some(ip) = addr() else { return };
    let mut server = Command::new(env!("CARGO_BIN_EXE_rfab_send_lat"))
        .args(["-p", "18604", "-T", "20"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let client = Command::new(env!("CARGO_BIN_EXE_rfab_send_bw"))
        .args(["-p", "18604", "-T", "20", &ip])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&client.stderr);
    assert!(!client.status.success());
    assert!(
        err.contains("the server refused") && err.contains("different test"),
        "{err}"
    );
    assert!(
        !server.wait().unwrap().success(),
        "the server exits with an error too"
    );
}

#[test]
fn inline_size_flag_reaches_the_queue_pair() {
    let Some(ip) = addr() else { return };
    let out = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18605,
        &["-s", "16", "-n", "50", "-I", "0"],
        &ip,
    );
    assert!(out.contains("Inline size    : 0"), "{out}");
    let out = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18606,
        &["-s", "16", "-n", "50", "-I", "64", "-x", "1"],
        &ip,
    );
    assert!(out.contains("Inline size    : 64"), "{out}");
}

#[test]
fn send_lat_over_datagrams_covers_every_size_to_the_mtu() {
    let Some(ip) = addr() else { return };
    let mtu = rfabric::verbs::devices().unwrap()[0].port.active_mtu as usize;
    let out = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18611,
        &["-c", "UD", "-a", "-n", "100", "--json"],
        &ip,
    );
    let rows = json_rows(&out);
    let want: Vec<usize> = (1..)
        .map(|k| 1usize << k)
        .take_while(|&s| s <= mtu)
        .collect();
    assert_eq!(rows.len(), want.len(), "{out}");
    for (row, size) in rows.iter().zip(&want) {
        assert!(row.contains(&format!("\"bytes\":{size},")), "{row}");
    }
    let table = run_pair(
        env!("CARGO_BIN_EXE_rfab_send_lat"),
        18612,
        &["-c", "UD", "-s", "8", "-n", "100"],
        &ip,
    );
    assert!(
        table.contains("FI_EP_DGRAM") && table.contains("fi_addr_ib_ud://"),
        "{table}"
    );
    // More than a datagram holds, or UD for bandwidth: refused with the reason.
    let big = std::process::Command::new(env!("CARGO_BIN_EXE_rfab_send_bw"))
        .args(["-c", "UD", &ip])
        .output()
        .unwrap();
    assert_eq!(big.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&big.stderr).contains("rfab_send_lat -c UD"));
}
