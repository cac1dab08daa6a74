//! Device tests of the C ABI: libfabric 1.17's core loads the provider library; `fi_info`
//! lists what rverbs offers; a C program (tests/capi/rverbs_capi.c, compiled here with the
//! system compiler against the installed headers) opens every object and runs traffic; and
//! `fi_pingpong -p rverbs` runs between two processes, checking its data.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// A directory holding the provider library under the name the core looks for.
fn provider_dir() -> PathBuf {
    provider_dir_for("info")
}

fn provider_dir_for(tag: &str) -> PathBuf {
    // The test runs from target/PROFILE/deps; the provider crate's library is in target/PROFILE.
    let exe = std::env::current_exe().unwrap();
    let lib = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("librverbs_fi.so");
    assert!(
        lib.exists(),
        "{} was not built (scripts/test-binaries builds it: cargo build -p rverbs-fi)",
        lib.display()
    );
    let dir = std::env::temp_dir().join(format!("rverbs-prov-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(&lib, dir.join("librverbs-fi.so")).unwrap();
    dir
}

fn fi_info(dir: &PathBuf, args: &[&str]) -> String {
    let out = Command::new("fi_info")
        .env("FI_PROVIDER_PATH", dir)
        .args(args)
        .output()
        .expect("fi_info (libfabric-bin) is installed by scripts/setup");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "fi_info {args:?} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn libfabric_loads_rverbs_and_fi_info_lists_its_endpoints() {
    let Some(info) = common::device_info() else {
        return;
    };
    let dir = provider_dir();
    let msg = fi_info(&dir, &["-p", "rverbs"]);
    assert!(msg.contains("provider: rverbs"), "{msg}");
    assert!(
        msg.contains(&format!("domain: {}", info.domain_attr.name)),
        "{msg}"
    );
    assert!(
        msg.contains("FI_EP_MSG") && msg.contains("FI_PROTO_RDMA_CM_IB_RC"),
        "{msg}"
    );
    let rdm = fi_info(&dir, &["-p", "rverbs", "-t", "FI_EP_RDM"]);
    assert!(rdm.contains("FI_EP_RDM"), "{rdm}");
    let dgram = fi_info(&dir, &["-p", "rverbs", "-t", "FI_EP_DGRAM"]);
    assert!(
        dgram.contains("FI_EP_DGRAM") && dgram.contains("FI_PROTO_IB_UD"),
        "{dgram}"
    );
    // Every attribute, as the core prints them from our C structs.
    let verbose = fi_info(&dir, &["-p", "rverbs", "-v"]);
    assert!(
        verbose.contains("fi_tx_attr") && verbose.contains("inject_size"),
        "{verbose}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn utility_providers_are_kept_off_rverbs_without_crashing() {
    if common::device_info().is_none() {
        return;
    }
    let dir = provider_dir_for("rxm");
    // The unfiltered listing asks every utility provider; none layers over rverbs.
    let all = fi_info(&dir, &[]);
    assert!(all.contains("provider: rverbs"), "{all}");
    assert!(!all.contains("rverbs;ofi_"), "{all}");
    // Asking for the layering by name is answered with "no data", not a crash.
    let out = Command::new("fi_info")
        .env("FI_PROVIDER_PATH", &dir)
        .args(["-p", "rverbs;ofi_rxm"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(61), "{out:?}");
    // FI_PROVIDER selects rverbs the way users do.
    let sel = Command::new("fi_info")
        .env("FI_PROVIDER_PATH", &dir)
        .env("FI_PROVIDER", "rverbs")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&sel.stdout);
    assert!(
        sel.status.success() && text.contains("provider: rverbs"),
        "{text}"
    );
    assert!(!text.contains("provider: verbs"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Compiles tests/capi/rverbs_capi.c against the installed libfabric headers.
fn capi_program(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/capi/rverbs_capi.c");
    let bin = dir.join("rverbs_capi");
    let out = Command::new("cc")
        .args([
            "-std=c11",
            "-D_GNU_SOURCE",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
        ])
        .arg(&bin)
        .arg(&src)
        .arg(concat!("-I", env!("CARGO_MANIFEST_DIR"), "/include"))
        .arg("-lfabric")
        .output()
        .expect("a C compiler (cc) is installed by scripts/setup");
    assert!(
        out.status.success(),
        "compiling {}: {}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

/// Runs one section of the C program through libfabric; it prints "ok <section>".
fn run_capi_section(section: &str) {
    run_capi_section_with(section, &[]);
}

/// As [`run_capi_section`], with more environment (`(name, value)`).
fn run_capi_section_with(section: &str, env: &[(&str, &str)]) {
    if common::device_info().is_none() {
        return;
    }
    let dir = provider_dir_for(section);
    let bin = capi_program(&dir);
    let out = run_with_timeout(
        Command::new(&bin)
            .arg(section)
            .env("FI_PROVIDER_PATH", &dir)
            // The peer section imports libfabric's shm as well.
            .env("FI_PROVIDER", "rverbs,shm")
            .envs(env.iter().copied()),
        Duration::from_secs(120),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(&format!("ok {section}")),
        "{section}: {:?}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn c_program_connects_and_moves_data_through_libfabric() {
    run_capi_section("msg");
}

#[test]
fn c_buffers_in_the_registration_cache_never_outlive_their_memory() {
    // Both endpoints are in one process: without the shm peer, their traffic goes over verbs.
    let verbs = ("FI_RVERBS_RDM_SHM", "0");
    run_capi_section_with("rdm-mr-cache", &[verbs]);
    // The same traffic with the cache off (each rendezvous registers for itself).
    run_capi_section_with(
        "rdm-mr-cache",
        &[verbs, ("FI_RVERBS_MR_CACHE_MAX_COUNT", "0")],
    );
}

#[test]
fn c_program_writes_and_reads_remote_memory_through_fi_rma() {
    run_capi_section("rma");
}

#[test]
fn c_program_writes_and_reads_remote_memory_over_rdm_endpoints() {
    run_capi_section("rdm-rma");
}

#[test]
fn c_program_runs_the_devices_atomics_over_rdm_endpoints() {
    run_capi_section("rdm-atomic");
}

#[test]
fn c_program_counts_completions_with_fi_cntr() {
    run_capi_section("cntr");
}

#[test]
fn c_program_drives_cqs_and_counters_through_a_poll_set() {
    run_capi_section("poll");
}

#[test]
fn c_program_waits_on_cqs_counters_and_eqs_through_a_wait_set() {
    run_capi_section("wait");
}

#[test]
fn c_program_gets_answers_that_honour_its_hints() {
    run_capi_section("hints");
}

#[test]
fn c_program_imports_shm_as_a_peer_of_the_software_srx() {
    run_capi_section("peer");
}

#[test]
fn c_program_runs_an_offload_peer_over_peer_transfer() {
    run_capi_section("transfer");
}

#[test]
fn c_program_runs_an_offload_peer_over_peer_transfer_on_rdm() {
    run_capi_section("rdm-transfer");
}

#[test]
fn c_program_sends_datagrams_through_libfabric() {
    run_capi_section("dgram");
}

#[test]
fn c_program_closed_reused_foreign_and_forged_handles_are_refused() {
    run_capi_section("handles");
}

#[test]
fn c_program_moves_tagged_and_untagged_messages_over_rdm_endpoints() {
    // Both endpoints are on this host: their messages go over the shm peer inside them.
    run_capi_section("rdm");
    // The same over verbs (RC loopback), with the shm peer turned off.
    run_capi_section_with("rdm", &[("FI_RVERBS_RDM_SHM", "0")]);
}

#[test]
fn c_program_bad_calls_get_their_error_codes() {
    run_capi_section("bad");
}

fn run_with_timeout(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// `fi_pingpong -p rverbs` between a server and a client process, with data checks (`-c`);
/// both must succeed and report every size with all iterations acknowledged.
fn pingpong(ep: &str, port: u16, sizes: &[&str]) {
    let Some(info) = common::device_info() else {
        return;
    };
    let addr = info.src_addr.expect("the device has an IPv4 address").ip();
    let dir = provider_dir_for(&format!("pp-{ep}"));
    let iters = "50";
    let port = port.to_string();
    // The server binds the control port (-B), the client connects to it (-P).
    let args = |port_flag| {
        [
            "-p", "rverbs", "-e", ep, "-I", iters, "-c", port_flag, &port,
        ]
    };
    let server = Command::new("fi_pingpong")
        .env("FI_PROVIDER_PATH", &dir)
        .args(args("-B"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fi_pingpong (libfabric-bin) is installed by scripts/setup");
    std::thread::sleep(Duration::from_millis(1500));
    let client = run_with_timeout(
        Command::new("fi_pingpong")
            .env("FI_PROVIDER_PATH", &dir)
            .args(args("-P"))
            .arg(addr.to_string()),
        Duration::from_secs(120),
    );
    let server = server.wait_with_output().unwrap();
    for (who, out) in [("client", &client), ("server", &server)] {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{ep} {who}: {:?}\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
        for size in sizes {
            let row = text
                .lines()
                .find(|l| l.split_whitespace().next() == Some(size))
                .unwrap_or_else(|| panic!("{ep} {who}: no row for {size}:\n{text}"));
            let f: Vec<&str> = row.split_whitespace().collect();
            assert_eq!((f[1], f[2]), (iters, &*format!("={iters}")), "{row}");
            let usec: f64 = f[6].parse().unwrap();
            assert!(usec > 0.0, "{row}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fi_pingpong_runs_over_rverbs_msg_endpoints() {
    pingpong("msg", 47611, &["64", "256", "1k", "4k", "64k", "1m"]);
}

#[test]
fn fi_pingpong_runs_over_rverbs_rdm_endpoints() {
    pingpong("rdm", 47613, &["64", "256", "1k", "4k", "64k", "1m"]);
}

#[test]
fn fi_pingpong_runs_over_rverbs_dgram_endpoints() {
    pingpong("dgram", 47612, &["64", "256", "1k"]);
}
