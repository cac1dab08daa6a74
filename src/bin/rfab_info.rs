//! `rfab_info`: like `fi_info`, lists what each RDMA device offers through rverbs.

use std::process::ExitCode;

use rfabric::core::env::KNOBS;
use rfabric::verbs::{devices, getinfo};
use rfabric::{EpType, Flags, Info};

const USAGE: &str = "usage: rfab_info [-n NODE] [-P PORT] [-d DOMAIN] [-s] [-v] [-e]
  -n NODE    destination (or, with -s, local address) to resolve
  -P PORT    service (port number)
  -d DOMAIN  only this device (domain name, e.g. rxe0)
  -s         source: NODE/PORT is the local address to listen on (FI_SOURCE)
  -v         verbose: every attribute, as fi_info -v prints them
  -e         list the FI_RVERBS_* environment variables and their defaults";

fn print_short(i: &Info) {
    println!("provider: {}", i.fabric_attr.prov_name);
    println!("    fabric: {}", i.fabric_attr.name);
    println!("    domain: {}", i.domain_attr.name);
    println!(
        "    version: {}.{}",
        i.fabric_attr.prov_version >> 16,
        i.fabric_attr.prov_version & 0xffff
    );
    println!(
        "    type: FI_EP_{}",
        format!("{:?}", i.ep_attr.ep_type).to_uppercase()
    );
    println!("    protocol: FI_PROTO_RDMA_CM_IB_RC");
}

fn print_verbose(i: &Info) {
    println!("---");
    println!("fi_info:");
    println!("    caps: {:?}", i.caps);
    println!("    mode: {:?}", i.mode);
    println!("    addr_format: {:?}", i.addr_format);
    println!(
        "    src_addr: {}",
        i.src_addr.map_or("(null)".into(), |a| a.to_string())
    );
    println!(
        "    dest_addr: {}",
        i.dest_addr.map_or("(null)".into(), |a| a.to_string())
    );
    let t = &i.tx_attr;
    println!("    fi_tx_attr:\n        caps: {:?}\n        msg_order: {:#x}\n        comp_order: {:#x}\n        inject_size: {}\n        size: {}\n        iov_limit: {}\n        rma_iov_limit: {}", t.caps, t.msg_order, t.comp_order, t.inject_size, t.size, t.iov_limit, t.rma_iov_limit);
    let r = &i.rx_attr;
    println!("    fi_rx_attr:\n        caps: {:?}\n        msg_order: {:#x}\n        comp_order: {:#x}\n        size: {}\n        iov_limit: {}", r.caps, r.msg_order, r.comp_order, r.size, r.iov_limit);
    let e = &i.ep_attr;
    println!("    fi_ep_attr:\n        type: {:?}\n        protocol: FI_PROTO_RDMA_CM_IB_RC\n        protocol_version: {}\n        max_msg_size: {}\n        tx_ctx_cnt: {}\n        rx_ctx_cnt: {}", e.ep_type, e.protocol_version, e.max_msg_size, e.tx_ctx_cnt, e.rx_ctx_cnt);
    let d = &i.domain_attr;
    println!("    fi_domain_attr:\n        name: {}\n        threading: {:?}\n        control_progress: {:?}\n        data_progress: {:?}\n        resource_mgmt: {:?}\n        mr_mode: {:?}\n        mr_key_size: {}\n        cq_data_size: {}\n        cq_cnt: {}\n        ep_cnt: {}\n        max_err_data: {}\n        mr_cnt: {}", d.name, d.threading, d.control_progress, d.data_progress, d.resource_mgmt, d.mr_mode, d.mr_key_size, d.cq_data_size, d.cq_cnt, d.ep_cnt, d.max_err_data, d.mr_cnt);
    let f = &i.fabric_attr;
    println!("    fi_fabric_attr:\n        name: {}\n        prov_name: {}\n        prov_version: {}.{}\n        api_version: {}.{}", f.name, f.prov_name, f.prov_version >> 16, f.prov_version & 0xffff, f.api_version >> 16, f.api_version & 0xffff);
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut node, mut port, mut domain, mut source, mut verbose) =
        (None, None, None, false, false);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-n" => node = args.next(),
            "-P" => port = args.next(),
            "-d" => domain = args.next(),
            "-s" => source = true,
            "-v" => verbose = true,
            "-e" => {
                for k in KNOBS {
                    println!("# {}: {}\n{}={}", k.name, k.help, k.name, k.default);
                }
                return ExitCode::SUCCESS;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("rfab_info: unknown argument {other:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let mut hints = Info::default();
    hints.ep_attr.ep_type = EpType::Unspec;
    if let Some(d) = &domain {
        hints.domain_attr.name = d.clone();
    }
    let flags = if source {
        Flags::SOURCE
    } else {
        Flags::empty()
    };
    match getinfo(node.as_deref(), port.as_deref(), flags, Some(&hints)) {
        Ok(infos) => {
            for i in &infos {
                if verbose {
                    print_verbose(i);
                } else {
                    print_short(i);
                }
            }
            if verbose {
                for d in devices().unwrap_or_default() {
                    println!("# {}: fw {} port {} active_mtu {} link_layer {} max_qp_wr {} max_sge {} max_cqe {} ipv4 {:?}",
                        d.name, d.attr.fw_ver, d.port.port_num, d.port.active_mtu,
                        if d.port.link_layer == 2 { "Ethernet" } else { "InfiniBand" },
                        d.attr.max_qp_wr, d.attr.max_sge, d.attr.max_cqe, d.ipv4);
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rfab_info: {e}");
            ExitCode::from(1)
        }
    }
}
