//! Finds the C libraries rfabric builds on and, when one is missing, says which Debian
//! package to install instead of failing inside a dependency's build script.

const LIBS: &[(&str, &str, &str)] = &[
    ("libibverbs", "1.8.28", "libibverbs-dev"),
    ("librdmacm", "1.2.28", "librdmacm-dev"),
    ("libfabric", "1.17", "libfabric-dev"),
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let mut missing = Vec::new();
    for (lib, version, package) in LIBS {
        let found = pkg_config::Config::new()
            .atleast_version(version)
            .cargo_metadata(false)
            .env_metadata(false)
            .probe(lib);
        if let Err(e) = found {
            eprintln!("error: {lib} >= {version} not found by pkg-config: {e}");
            missing.push(*package);
        }
    }
    if !missing.is_empty() {
        eprintln!(
            "\nrfabric needs: apt-get install {} pkg-config   (scripts/setup installs everything)\n",
            missing.join(" ")
        );
        std::process::exit(1);
    }
}
