//! Generates the libfabric 1.17 bindings and a C-compiled table of struct sizes and
//! field offsets, so the layout tests compare bindgen's view with the C compiler's.

use std::fmt::Write as _;
use std::path::PathBuf;

/// Structs whose layout the provider relies on, with the fields it touches.
const LAYOUT: &[(&str, &[&str])] = &[
    ("fid", &["fclass", "context", "ops"]),
    (
        "fi_ops",
        &[
            "size", "close", "bind", "control", "ops_open", "tostr", "ops_set",
        ],
    ),
    (
        "fi_info",
        &[
            "next",
            "caps",
            "mode",
            "addr_format",
            "src_addrlen",
            "dest_addrlen",
            "src_addr",
            "dest_addr",
            "handle",
            "tx_attr",
            "rx_attr",
            "ep_attr",
            "domain_attr",
            "fabric_attr",
            "nic",
        ],
    ),
    (
        "fi_tx_attr",
        &[
            "caps",
            "mode",
            "op_flags",
            "msg_order",
            "comp_order",
            "inject_size",
            "size",
            "iov_limit",
            "rma_iov_limit",
            "tclass",
        ],
    ),
    (
        "fi_rx_attr",
        &[
            "caps",
            "mode",
            "op_flags",
            "msg_order",
            "comp_order",
            "total_buffered_recv",
            "size",
            "iov_limit",
        ],
    ),
    (
        "fi_ep_attr",
        &[
            "type_",
            "protocol",
            "protocol_version",
            "max_msg_size",
            "msg_prefix_size",
            "max_order_raw_size",
            "max_order_war_size",
            "max_order_waw_size",
            "mem_tag_format",
            "tx_ctx_cnt",
            "rx_ctx_cnt",
            "auth_key_size",
            "auth_key",
        ],
    ),
    (
        "fi_domain_attr",
        &[
            "domain",
            "name",
            "threading",
            "control_progress",
            "data_progress",
            "resource_mgmt",
            "av_type",
            "mr_mode",
            "mr_key_size",
            "cq_data_size",
            "cq_cnt",
            "ep_cnt",
            "tx_ctx_cnt",
            "rx_ctx_cnt",
            "max_ep_tx_ctx",
            "max_ep_rx_ctx",
            "max_ep_stx_ctx",
            "max_ep_srx_ctx",
            "cntr_cnt",
            "mr_iov_limit",
            "caps",
            "mode",
            "auth_key",
            "auth_key_size",
            "max_err_data",
            "mr_cnt",
            "tclass",
        ],
    ),
    (
        "fi_fabric_attr",
        &["fabric", "name", "prov_name", "prov_version", "api_version"],
    ),
    (
        "fi_provider",
        &[
            "version",
            "fi_version",
            "context",
            "name",
            "getinfo",
            "fabric",
            "cleanup",
        ],
    ),
    (
        "fi_cq_attr",
        &[
            "size",
            "flags",
            "format",
            "wait_obj",
            "signaling_vector",
            "wait_cond",
            "wait_set",
        ],
    ),
    (
        "fi_eq_attr",
        &["size", "flags", "wait_obj", "signaling_vector", "wait_set"],
    ),
    ("fi_cntr_attr", &["events", "wait_obj", "wait_set", "flags"]),
    (
        "fi_ops_cntr",
        &[
            "size", "read", "readerr", "add", "set", "wait", "adderr", "seterr",
        ],
    ),
    ("fid_cntr", &["fid", "ops"]),
    ("fi_poll_attr", &["flags"]),
    ("fi_ops_poll", &["size", "poll", "poll_add", "poll_del"]),
    ("fid_poll", &["fid", "ops"]),
    ("fi_wait_attr", &["wait_obj", "flags"]),
    ("fi_ops_wait", &["size", "wait"]),
    ("fid_wait", &["fid", "ops"]),
    (
        "fi_cq_tagged_entry",
        &["op_context", "flags", "len", "buf", "data", "tag"],
    ),
    (
        "fi_cq_err_entry",
        &[
            "op_context",
            "flags",
            "len",
            "buf",
            "data",
            "tag",
            "olen",
            "err",
            "prov_errno",
            "err_data",
            "err_data_size",
        ],
    ),
    ("fi_eq_entry", &["fid", "context", "data"]),
    ("fi_eq_cm_entry", &["fid", "info", "data"]),
    (
        "fi_eq_err_entry",
        &[
            "fid",
            "context",
            "data",
            "err",
            "prov_errno",
            "err_data",
            "err_data_size",
        ],
    ),
    (
        "fi_msg",
        &["msg_iov", "desc", "iov_count", "addr", "context", "data"],
    ),
    (
        "fi_ops_msg",
        &[
            "size",
            "recv",
            "recvv",
            "recvmsg",
            "send",
            "sendv",
            "sendmsg",
            "inject",
            "senddata",
            "injectdata",
        ],
    ),
    (
        "fi_ops_cm",
        &[
            "size", "setname", "getname", "getpeer", "connect", "listen", "accept", "reject",
            "shutdown", "join",
        ],
    ),
    (
        "fi_ops_cq",
        &[
            "size",
            "read",
            "readfrom",
            "readerr",
            "sread",
            "sreadfrom",
            "signal",
            "strerror",
        ],
    ),
    (
        "fi_ops_eq",
        &["size", "read", "readerr", "write", "sread", "strerror"],
    ),
    (
        "fi_ops_ep",
        &[
            "size",
            "cancel",
            "getopt",
            "setopt",
            "tx_ctx",
            "rx_ctx",
            "rx_size_left",
            "tx_size_left",
        ],
    ),
    (
        "fi_ops_domain",
        &[
            "size",
            "av_open",
            "cq_open",
            "endpoint",
            "scalable_ep",
            "cntr_open",
            "poll_open",
            "stx_ctx",
            "srx_ctx",
            "query_atomic",
            "query_collective",
        ],
    ),
    (
        "fi_ops_fabric",
        &[
            "size",
            "domain",
            "passive_ep",
            "eq_open",
            "wait_open",
            "trywait",
            "domain2",
        ],
    ),
    (
        "fi_mr_attr",
        &[
            "mr_iov",
            "iov_count",
            "access",
            "offset",
            "requested_key",
            "context",
            "auth_key_size",
            "auth_key",
            "iface",
            "device",
        ],
    ),
    (
        "fid_ep",
        &[
            "fid",
            "ops",
            "cm",
            "msg",
            "rma",
            "tagged",
            "atomic",
            "collective",
        ],
    ),
    ("fid_peer_cq", &["fid", "owner_ops"]),
    ("fi_ops_cq_owner", &["size", "write", "writeerr"]),
    ("fi_peer_cq_context", &["size", "cq"]),
    (
        "fi_peer_rx_entry",
        &[
            "next",
            "prev",
            "srx",
            "addr",
            "size",
            "tag",
            "flags",
            "context",
            "count",
            "desc",
            "peer_context",
            "owner_context",
            "iov",
        ],
    ),
    (
        "fi_ops_srx_owner",
        &[
            "size",
            "get_msg",
            "get_tag",
            "queue_msg",
            "queue_tag",
            "free_entry",
        ],
    ),
    (
        "fi_ops_srx_peer",
        &[
            "size",
            "start_msg",
            "start_tag",
            "discard_msg",
            "discard_tag",
        ],
    ),
    ("fid_peer_srx", &["ep_fid", "owner_ops", "peer_ops"]),
    ("fi_peer_srx_context", &["size", "srx"]),
    (
        "fi_peer_transfer_context",
        &["size", "info", "ep", "peer_ops"],
    ),
    ("fi_ops_transfer_peer", &["size", "complete", "comperr"]),
    ("fid_peer_av", &["fid", "owner_ops"]),
    ("fi_ops_av_owner", &["size", "query", "ep_addr"]),
    ("fi_peer_domain_context", &["size", "domain"]),
    ("fi_peer_eq_context", &["size", "eq"]),
];

/// libfabric's flag macros are 64-bit (`1ULL << n`); errno macros are `int`.
#[derive(Debug)]
struct MacroTypes;

impl bindgen::callbacks::ParseCallbacks for MacroTypes {
    fn int_macro(&self, name: &str, _value: i64) -> Option<bindgen::callbacks::IntKind> {
        use bindgen::callbacks::IntKind;
        if name.starts_with("FI_E")
            && !name.starts_with("FI_EP_")
            && !name.starts_with("FI_EXPLICIT")
        {
            Some(IntKind::Int)
        } else if name.starts_with("FI_") {
            Some(IntKind::U64)
        } else {
            None
        }
    }
}

const PACKAGES: &[(&str, &str, &str)] = &[("libfabric", "1.17", "libfabric-dev")];

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    let mut include_args = Vec::new();
    for (lib, version, package) in PACKAGES {
        match pkg_config::Config::new()
            .atleast_version(version)
            .probe(lib)
        {
            Ok(found) => {
                for p in found.include_paths {
                    include_args.push(format!("-I{}", p.display()));
                }
            }
            Err(e) => {
                eprintln!(
                    "\nerror: {lib} >= {version} not found by pkg-config ({e}).\n\
                     fix: apt-get install {package} pkg-config   (or run scripts/setup)\n"
                );
                std::process::exit(1);
            }
        }
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_args(&include_args)
        .allowlist_type("fi_.*|fid_.*|fid")
        .allowlist_var("FI_.*")
        .blocklist_item("FI_SHARED_CONTEXT|FI_ADDR_UNSPEC|FI_ADDR_NOTAVAIL|FI_KEY_NOTAVAIL")
        .parse_callbacks(Box::new(MacroTypes))
        .allowlist_function("fi_version|fi_strerror|fi_allocinfo|fi_dupinfo|fi_freeinfo|fi_param_.*|fi_log.*|fi_getinfo|fi_fabric")
        .blocklist_type("iovec|sockaddr.*|timespec")
        .raw_line("pub use libc::{iovec, sockaddr};")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .unwrap_or_else(|e| {
            eprintln!("\nerror: bindgen over the libfabric 1.17 headers failed: {e}\nfix: apt-get install libclang1-14 libclang-common-14-dev libfabric-dev\n");
            std::process::exit(1);
        });
    bindings
        .write_to_file(out.join("fabric.rs"))
        .expect("write bindings to OUT_DIR");

    // One list drives both sides: a C table (sizeof/offsetof as the compiler sees them)
    // and the Rust checks (size_of/offset_of as bindgen laid them out).
    let mut c = String::from("#include <stddef.h>\n#include \"wrapper.h\"\n");
    c.push_str("struct rfab_layout { const char *name; size_t value; };\n");
    c.push_str("const struct rfab_layout rfab_layout_table[] = {\n");
    let mut rs = String::from("// generated by sys/build.rs\n&[\n");
    for (ty, fields) in LAYOUT {
        writeln!(c, "  {{\"{ty}\", sizeof(struct {ty})}},").unwrap();
        writeln!(rs, "  (\"{ty}\", ::core::mem::size_of::<{ty}>()),").unwrap();
        for f in *fields {
            let cf = f.trim_end_matches('_');
            writeln!(c, "  {{\"{ty}.{cf}\", offsetof(struct {ty}, {cf})}},").unwrap();
            writeln!(rs, "  (\"{ty}.{cf}\", ::core::mem::offset_of!({ty}, {f})),").unwrap();
        }
    }
    c.push_str("  {0, 0}\n};\n");
    rs.push_str("]\n");
    let c_path = out.join("layout.c");
    std::fs::write(&c_path, c).expect("write layout.c");
    std::fs::write(out.join("layout.rs"), rs).expect("write layout.rs");
    cc::Build::new()
        .file(&c_path)
        .include(".")
        .includes(
            include_args
                .iter()
                .map(|a| a.trim_start_matches("-I").to_string()),
        )
        .compile("rfab_layout");
}
