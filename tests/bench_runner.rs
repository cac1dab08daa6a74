//! Host test of `scripts/bench-lib.sh`, the runner `scripts/bench` uses: a perftest
//! reference run that fails (its server gives up on a busy machine) is tried once more and
//! then marked missing, and does not fail the benchmark; a failed rfabric run does.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A fake benchmark command: fails its first `fail_first` runs as a client (the server
/// side, without a host argument, always succeeds), then succeeds; counts client runs.
fn fake(dir: &Path, name: &str, fail_first: u32) -> PathBuf {
    let p = dir.join(name);
    let count = dir.join(format!("{name}.count"));
    std::fs::write(
        &p,
        format!(
            "#!/usr/bin/env bash\n\
             # the client is the run with a host argument (the last one)\n\
             case \"${{@: -1}}\" in 127.*) ;; *) exit 0 ;; esac\n\
             n=$(( $(cat {c} 2>/dev/null || echo 0) + 1 )); echo $n > {c}\n\
             if [ $n -le {fail_first} ]; then echo \"Correlation coefficient r^2 < 0.9, Can't produce a report\"; exit 1; fi\n\
             echo \"2 1000 11.1\"\n",
            c = count.display()
        ),
    )
    .unwrap();
    Command::new("chmod").arg("+x").arg(&p).status().unwrap();
    p
}

/// Runs `pair NAME CMD -- 127.0.0.1` for each (name, fake) and returns `fail`.
fn run(dir: &Path, pairs: &[(&str, &Path)]) -> String {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench-lib.sh");
    let mut script = format!(
        "set -u; out={d}; port=30000; fail=0; pin() {{ \"${{@:2}}\"; }}; . {lib}\n",
        d = dir.display(),
        lib = lib.display()
    );
    for (name, cmd) in pairs {
        script += &format!("pair {name} {} -- 127.0.0.1\n", cmd.display());
    }
    script += "echo \"fail=$fail\"\n";
    let o = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rfabric-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_reference_run_that_fails_once_is_retried_and_kept() {
    let d = scratch("retry");
    let ib = fake(&d, "ib_send_lat", 1);
    let out = run(&d, &[("ib_send_lat_2", &ib)]);
    assert!(out.contains("trying once more"), "{out}");
    assert!(out.contains("fail=0"), "{out}");
    assert!(
        d.join("ib_send_lat_2.txt").exists(),
        "the second run's output is kept"
    );
}

#[test]
fn a_reference_run_that_fails_twice_is_missing_and_does_not_fail_the_bench() {
    let d = scratch("missing");
    let ib = fake(&d, "ib_send_lat", 5);
    let rfab = fake(&d, "rfab_send_lat", 0);
    let out = run(&d, &[("rfab_send_lat_2", &rfab), ("ib_send_lat_2", &ib)]);
    assert!(out.contains("missing in the table"), "{out}");
    assert!(out.contains("fail=0"), "rfabric ran fine: {out}");
    assert!(
        !d.join("ib_send_lat_2.txt").exists(),
        "no data row for the table"
    );
    assert!(d.join("ib_send_lat_2.failed.txt").exists());
    assert_eq!(
        std::fs::read_to_string(d.join("ib_send_lat.count"))
            .unwrap()
            .trim(),
        "2"
    );
}

#[test]
fn a_failed_rfabric_run_fails_the_bench_without_a_retry() {
    let d = scratch("ours");
    let rfab = fake(&d, "rfab_send_lat", 1);
    let out = run(&d, &[("rfab_send_lat_2", &rfab)]);
    assert!(out.contains("FAILED: rfab_send_lat_2"), "{out}");
    assert!(out.contains("fail=1"), "{out}");
    assert_eq!(
        std::fs::read_to_string(d.join("rfab_send_lat.count"))
            .unwrap()
            .trim(),
        "1"
    );
}
