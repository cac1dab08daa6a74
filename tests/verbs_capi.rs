//! Device tests of the C ABI: libfabric 1.17's core loads the provider library and
//! `fi_info` lists what rverbs offers.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// A directory holding the provider library under the name the core looks for.
fn provider_dir() -> PathBuf {
    let deps = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let lib = deps.join("librfabric.so");
    assert!(
        lib.exists(),
        "{} was not built (cargo test builds the cdylib)",
        lib.display()
    );
    let dir = std::env::temp_dir().join(format!("rverbs-prov-{}", std::process::id()));
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
