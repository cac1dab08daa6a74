//! Device discovery and `fi_getinfo` for rverbs.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};

use rfabric_sys::cm::{CmId, REJECT_PRIVATE_DATA_MAX};
use rfabric_sys::fabric as fi;
use rfabric_sys::verbs::{Context, DeviceAttr, PortAttr};

use crate::core::env;
use crate::core::error::{errno, Error, Result};
use crate::core::flags::*;
use crate::core::info::*;
use crate::core::rdm::RdmName;
use crate::verbs::{no_device_error, os_err, PROVIDER_NAME, PROVIDER_VERSION};

/// A verbs device as rverbs sees it: its attributes and the port it uses.
#[derive(Clone, Debug)]
pub struct Device {
    pub name: String,
    pub attr: DeviceAttr,
    pub port: PortAttr,
    /// GID index 0 (the subnet prefix names the fabric).
    pub gid0: [u8; 16],
    /// The IPv4 address behind the first IPv4-mapped GID (RoCE v2), if any.
    pub ipv4: Option<Ipv4Addr>,
    /// The GID datagram endpoints are named by and send from: the IPv4-mapped one when
    /// there is one (RoCE v2 routes it), else index 0.
    pub ud_gid: [u8; 16],
    pub ud_gid_index: u8,
    pub(crate) context: Context,
}

/// Every verbs device rdma_cm can use, with its first active port (else port 1).
pub fn devices() -> Result<Vec<Device>> {
    crate::verbs::install_sys_log();
    let ctxs = Context::devices().map_err(os_err("rdma_get_devices"))?;
    let mut out = Vec::with_capacity(ctxs.len());
    for ctx in ctxs {
        let name = ctx.name();
        let attr = match ctx.query_device() {
            Ok(a) => a,
            Err(e) => {
                crate::fi_warn!(
                    "core",
                    "skipping {name}: ibv_query_device failed: {}",
                    std::io::Error::from_raw_os_error(e)
                );
                continue;
            }
        };
        let mut chosen = None;
        for p in 1..=attr.phys_port_cnt.max(1) {
            if let Ok(pa) = ctx.query_port(p) {
                let active = pa.is_active();
                if chosen.is_none() || active {
                    chosen = Some(pa);
                }
                if active {
                    break;
                }
            }
        }
        let Some(port) = chosen else {
            crate::fi_warn!("core", "skipping {name}: no port could be queried");
            continue;
        };
        if !port.is_active() {
            crate::fi_info!(
                "core",
                "{name} port {} is not active (state {})",
                port.port_num,
                port.state
            );
        }
        let gid0 = ctx.query_gid(port.port_num, 0).unwrap_or([0; 16]);
        let mapped = (0..port.gid_tbl_len.min(16) as i32)
            .filter_map(|i| ctx.query_gid(port.port_num, i).ok().map(|g| (i, g)))
            .find(|(_, g)| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff);
        let ipv4 = mapped.map(|(_, g)| Ipv4Addr::new(g[12], g[13], g[14], g[15]));
        let (ud_gid_index, ud_gid) = mapped.map_or((0, gid0), |(i, g)| (i as u8, g));
        crate::fi_debug!(
            "core",
            "found {name}: port {} mtu {} max_sge {} max_qp_wr {}",
            port.port_num,
            port.active_mtu,
            attr.max_sge,
            attr.max_qp_wr
        );
        out.push(Device {
            name,
            attr,
            port,
            gid0,
            ipv4,
            ud_gid,
            ud_gid_index,
            context: ctx,
        });
    }
    Ok(out)
}

/// The largest `FI_RVERBS_INLINE_SIZE` taken: inline data is a `u32` in verbs, and no
/// device inlines more than a few KiB.
pub const MAX_INLINE: usize = 64 * 1024;

/// The inject size a device supports: inline data shares the work request's space with its
/// scatter list, so `max_sge` elements of 16 bytes bound it. No trial QP is created.
fn inline_size(dev: &Device) -> Result<usize> {
    checked_inline(
        env::get_usize("FI_RVERBS_INLINE_SIZE")?,
        dev.attr.max_sge as usize * 16,
    )
}

fn checked_inline(knob: Option<usize>, derived: usize) -> Result<usize> {
    match knob {
        None => Ok(derived),
        Some(n) if n <= MAX_INLINE => Ok(n),
        Some(n) => Err(Error::new(
            errno::EINVAL,
            format!("FI_RVERBS_INLINE_SIZE={n} is more than a work request can carry inline (at most {MAX_INLINE})"),
        )),
    }
}

/// The MSG endpoint info a device offers, before addresses and hints.
/// CQs a process can actually open (`domain_attr.cq_cnt`): the device's `max_cq` (a
/// million on rxe), bounded by the process's memory maps, since each CQ maps its queue
/// (rxe: one map; `vm.max_map_count`, 65530 by default, is reached first). A quarter of
/// them is left to CQs; the rest serve QPs, libraries and the heap.
fn cq_budget(max_cq: usize) -> usize {
    let maps = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(65530);
    max_cq.min(maps / 4).max(1)
}

/// Receive ranges an MSG info promises: what both the QP and the device's SRQ take, so an
/// application that passes `info->rx_attr` to `fi_srx_context` gets one (rxe: 32 vs 27).
fn rx_iov_limit(dev: &Device) -> usize {
    let a = &dev.attr;
    if a.max_srq == 0 {
        a.max_sge as usize
    } else {
        a.max_sge.min(a.max_srq_sge) as usize
    }
}

/// Counters a domain offers (`domain_attr.cntr_cnt`) on MSG and DGRAM infos.
const CNTR_CNT: usize = 1 << 16;

/// Peers on this host and on others are both reachable (secondary capabilities Open MPI's
/// `mtl ofi` asks for).
const COMM_CAPS: Flags = Flags::LOCAL_COMM.union(Flags::REMOTE_COMM);

/// The registration modes RMA needs: keys are verbs rkeys (the device picks them) and
/// remote addresses are virtual addresses.
const RMA_MR_MODE: MrMode = MrMode::LOCAL
    .union(MrMode::VIRT_ADDR)
    .union(MrMode::PROV_KEY);

/// An MSG or RDM info without RMA, for applications that do not ask for it (their caps
/// name none of it) or cannot register memory as it needs (their mr_mode lacks
/// `FI_MR_PROV_KEY`): they keep the plain answer, `plain` (MSG: `FI_MR_LOCAL`; RDM:
/// nothing asked of them). With RMA, an mr_mode without `FI_MR_VIRT_ADDR` gets offset
/// addressing (`Domain::offset_rma`).
fn without_rma_unless_asked(i: &mut Info, hints: &Info, plain: MrMode) {
    let asked = (hints.caps | hints.tx_attr.caps | hints.rx_attr.caps).intersects(REMOTE_KEY_CAPS);
    let hinted = hinted_mr_mode(hints);
    let mr_ok = hinted.is_none_or(|m| m.contains(MrMode::PROV_KEY));
    if asked || (hints.caps.is_empty() && mr_ok) {
        if hinted.is_some_and(|m| !m.contains(MrMode::VIRT_ADDR)) {
            i.domain_attr.mr_mode -= MrMode::VIRT_ADDR;
        }
        return;
    }
    i.caps -= REMOTE_KEY_CAPS;
    i.tx_attr.caps -= REMOTE_KEY_CAPS;
    i.rx_attr.caps -= REMOTE_KEY_CAPS;
    i.domain_attr.mr_mode = plain;
}

/// `FI_MR_ALLOCATED` echoed to an application that accepts it where it registers memory:
/// verbs registers only memory that is mapped.
fn allocated_if_accepted(i: &mut Info, hints: &Info) {
    let registers = i.domain_attr.mr_mode.contains(MrMode::LOCAL) || i.caps.contains(Flags::RMA);
    if registers && hinted_mr_mode(hints).is_some_and(|m| m.contains(MrMode::ALLOCATED)) {
        i.domain_attr.mr_mode |= MrMode::ALLOCATED;
    }
}

/// `FI_RMA_EVENT` on an RDM info only for applications that ask for it: a secondary
/// capability that costs performance is not reported unasked (fi_getinfo(3)).
fn without_rma_event_unless_asked(i: &mut Info, hints: &Info) {
    if !(hints.caps | hints.rx_attr.caps).contains(Flags::RMA_EVENT) {
        i.caps -= Flags::RMA_EVENT;
        i.rx_attr.caps -= Flags::RMA_EVENT;
    }
}

pub(crate) fn msg_info(dev: &Device) -> Result<Info> {
    let a = &dev.attr;
    let caps = Flags::MSG | Flags::SEND | Flags::RECV | Flags::MULTI_RECV | RMA_CAPS | COMM_CAPS;
    let max_msg = dev.port.max_msg_sz as usize;
    let prefix = u64::from_be_bytes(dev.gid0[..8].try_into().expect("8 bytes"));
    let mut i = Info {
        caps,
        addr_format: AddrFormat::SockaddrIn,
        ..Default::default()
    };
    i.tx_attr = TxAttr {
        caps: Flags::MSG | Flags::SEND | Flags::RMA | Flags::READ | Flags::WRITE,
        msg_order: RC_MSG_ORDER,
        comp_order: fi::FI_ORDER_STRICT,
        inject_size: inline_size(dev)?,
        size: a.max_qp_wr as usize,
        iov_limit: a.max_sge as usize,
        rma_iov_limit: 1,
        ..Default::default()
    };
    i.rx_attr = RxAttr {
        caps: Flags::MSG
            | Flags::RECV
            | Flags::MULTI_RECV
            | Flags::RMA
            | Flags::REMOTE_READ
            | Flags::REMOTE_WRITE,
        msg_order: RC_MSG_ORDER,
        comp_order: fi::FI_ORDER_STRICT,
        size: a.max_qp_wr as usize,
        iov_limit: rx_iov_limit(dev),
        // A write with remote CQ data (write with immediate) consumes a receive at the
        // target, as with libfabric's verbs provider: fabtests' `fi_rma_bw -o writedata`
        // posts receives for them when it finds this bit.
        mode: Mode::RX_CQ_DATA,
        ..Default::default()
    };
    i.ep_attr = EpAttr {
        ep_type: EpType::Msg,
        protocol: PROTO_RDMA_CM_IB_RC,
        protocol_version: 1,
        max_msg_size: max_msg,
        max_order_raw_size: max_msg,
        max_order_war_size: max_msg,
        max_order_waw_size: max_msg,
        tx_ctx_cnt: 1,
        rx_ctx_cnt: 1,
        ..Default::default()
    };
    i.domain_attr = DomainAttr {
        name: dev.name.clone(),
        threading: Threading::Safe,
        control_progress: Progress::Auto,
        data_progress: Progress::Manual,
        resource_mgmt: ResourceMgmt::Enabled,
        av_type: AvType::Unspec,
        // Descriptors on every data call; RMA addresses are virtual addresses under keys
        // the device chose. Without RMA only LOCAL is needed (`without_rma`).
        mr_mode: RMA_MR_MODE,
        mr_key_size: 4,
        cq_data_size: 4,
        cq_cnt: cq_budget(a.max_cq as usize),
        ep_cnt: a.max_qp as usize,
        tx_ctx_cnt: a.max_qp as usize,
        rx_ctx_cnt: a.max_qp as usize,
        max_ep_tx_ctx: 1,
        max_ep_rx_ctx: 1,
        max_ep_stx_ctx: 0,
        // A MSG endpoint may take a device SRQ (`fi_srx_context`).
        max_ep_srx_ctx: 1,
        // Counters are software (the CQs count into them): no device limit.
        cntr_cnt: CNTR_CNT,
        mr_iov_limit: 1,
        caps: Flags::LOCAL_COMM | Flags::REMOTE_COMM,
        mode: Mode::empty(),
        max_err_data: REJECT_PRIVATE_DATA_MAX,
        mr_cnt: a.max_mr as usize,
    };
    i.fabric_attr = FabricAttr {
        name: format!("IB-0x{prefix:016x}"),
        prov_name: PROVIDER_NAME.into(),
        prov_version: PROVIDER_VERSION,
        api_version: fi::RFABRIC_FI_VERSION,
    };
    Ok(i)
}

/// Bytes of the GRH at the start of every UD receive: the `FI_MSG_PREFIX` size.
pub const DGRAM_PREFIX: usize = rfabric_sys::verbs::GRH_LEN;

/// The DGRAM endpoint info a device offers: UD queue pairs, one MTU per message.
pub(crate) fn dgram_info(dev: &Device) -> Result<Info> {
    let mut i = msg_info(dev)?;
    i.domain_attr.max_ep_srx_ctx = 0;
    i.rx_attr.mode -= Mode::RX_CQ_DATA; // no RMA
    let mtu = dev.port.active_mtu as usize;
    // FI_SOURCE / FI_SOURCE_ERR cost a GRH slot and a lookup per receive: only on request.
    i.caps = Flags::MSG
        | Flags::SEND
        | Flags::RECV
        | Flags::MULTICAST
        | Flags::SOURCE
        | Flags::SOURCE_ERR
        | COMM_CAPS;
    i.addr_format = AddrFormat::IbUd;
    i.tx_attr.caps = Flags::MSG | Flags::SEND;
    i.rx_attr.caps = Flags::MSG | Flags::RECV;
    i.domain_attr.mr_mode = MrMode::LOCAL;
    // Datagrams carry no order and no guarantee.
    i.tx_attr.msg_order = 0;
    i.rx_attr.msg_order = 0;
    i.tx_attr.inject_size = i.tx_attr.inject_size.min(mtu);
    i.ep_attr.ep_type = EpType::Dgram;
    i.ep_attr.protocol = fi::FI_PROTO_IB_UD;
    i.ep_attr.max_msg_size = mtu;
    i.ep_attr.max_order_raw_size = 0;
    i.ep_attr.max_order_war_size = 0;
    i.ep_attr.max_order_waw_size = 0;
    i.domain_attr.max_err_data = 0;
    Ok(i)
}

/// `FI_TAG_GENERIC`: all 64 tag bits are the application's.
pub const TAG_GENERIC: u64 = 0xaaaa_aaaa_aaaa_aaaa;

/// The RDM endpoint info a device offers: RC connections made on first use, software
/// matching, eager messages through provider buffers (no registration asked of the
/// application).
pub(crate) fn rdm_info(dev: &Device) -> Result<Info> {
    let mut i = msg_info(dev)?;
    // Its receives go to its own engine: an application's SRX is not bound to it.
    i.domain_attr.max_ep_srx_ctx = 0;
    // Remote CQ data follows a write as a notice: no receive of the application's goes.
    i.rx_attr.mode -= Mode::RX_CQ_DATA;
    let eager = crate::verbs::rdm_ep::eager_size()?;
    let recv = Flags::MSG
        | Flags::TAGGED
        | Flags::RECV
        | Flags::DIRECTED_RECV
        | Flags::SOURCE
        | Flags::MULTI_RECV;
    // Atomics are the device's, on the connections RMA uses (`core::atomic`).
    i.caps = Flags::MSG | Flags::TAGGED | Flags::SEND | recv | REMOTE_KEY_CAPS | COMM_CAPS;
    // Targets count RMA on notices initiators send after each operation: offered where
    // asked only (`without_rma_event_unless_asked`), as it costs every write a message.
    i.caps |= Flags::RMA_EVENT;
    i.addr_format = AddrFormat::Unspec;
    i.tx_attr.caps = Flags::MSG
        | Flags::TAGGED
        | Flags::SEND
        | Flags::RMA
        | Flags::ATOMIC
        | Flags::READ
        | Flags::WRITE;
    i.rx_attr.caps = recv
        | Flags::RMA
        | Flags::ATOMIC
        | Flags::REMOTE_READ
        | Flags::REMOTE_WRITE
        | Flags::RMA_EVENT;
    i.tx_attr.msg_order = fi::FI_ORDER_SAS;
    i.rx_attr.msg_order = fi::FI_ORDER_SAS;
    i.tx_attr.comp_order = fi::FI_ORDER_NONE;
    i.rx_attr.comp_order = fi::FI_ORDER_NONE;
    i.tx_attr.inject_size = eager;
    i.tx_attr.iov_limit = crate::verbs::rdm_ep::tx_iov_limit()?;
    i.rx_attr.iov_limit = crate::verbs::rdm_ep::RX_IOV_MAX;
    i.ep_attr.ep_type = EpType::Rdm;
    i.ep_attr.protocol = fi::FI_PROTO_UNSPEC;
    // Larger than the eager size, the receiver reads the message (rendezvous), in as many
    // RDMA reads as the port's message size needs.
    i.ep_attr.max_msg_size = crate::verbs::rdm_ep::max_msg_size(dev.port.max_msg_sz as usize);
    i.ep_attr.max_order_raw_size = 0;
    i.ep_attr.max_order_war_size = 0;
    i.ep_attr.max_order_waw_size = 0;
    i.ep_attr.mem_tag_format = TAG_GENERIC;
    // Messages need no registration; RMA targets are virtual addresses under device keys
    // (an info without RMA asks nothing: `without_rma_unless_asked`).
    i.domain_attr.mr_mode = RMA_MR_MODE - MrMode::LOCAL;
    i.domain_attr.cq_data_size = 8;
    i.domain_attr.max_err_data = 0;
    Ok(i)
}

fn resolve(node: Option<&str>, service: Option<&str>, passive: bool) -> Result<Option<SocketAddr>> {
    if node.is_none() && service.is_none() {
        return Ok(None);
    }
    let port: u16 = match service {
        None => 0,
        Some(s) => s.parse().map_err(|_| {
            Error::new(errno::EINVAL, format!("service {s:?} is not a port number"))
        })?,
    };
    let host = match node {
        Some(n) => n,
        None if passive => "0.0.0.0",
        None => {
            return Err(Error::new(
                errno::EINVAL,
                "a service without a node names no destination: give the server's address",
            ))
        }
    };
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::new(errno::EINVAL, format!("cannot resolve {host:?}: {e}")))?;
    let first = addrs.next();
    first
        .ok_or_else(|| Error::new(errno::EINVAL, format!("{host:?} resolves to no address")))
        .map(Some)
}

fn cm_timeout() -> Result<i32> {
    Ok(env::get_usize_or("FI_RVERBS_CM_TIMEOUT_MS", 2000)?.min(i32::MAX as usize) as i32)
}

/// Resolves `dst` (from `src`, if given) with rdma_cm: the device and local address that reach it.
pub(crate) fn resolve_route(src: Option<&SocketAddr>, dst: &SocketAddr) -> Result<CmId> {
    let id = CmId::new(None).map_err(os_err("rdma_create_id"))?;
    route_on(&id, src, dst)?;
    Ok(id)
}

/// Resolves the route to `dst` on `id`, from `src` or, with none, from the address `id` is
/// bound to (a passive endpoint's, given to an active one) or any.
pub(crate) fn route_on(id: &CmId, src: Option<&SocketAddr>, dst: &SocketAddr) -> Result<()> {
    let t = cm_timeout()?;
    id.resolve_addr(src, dst, t).map_err(|e| {
        Error::os(e, "rdma_resolve_addr")
            .with_prov_errno(e)
            .tap_cause(format!("no RDMA route to {dst}"))
    })?;
    id.resolve_route(t).map_err(os_err("rdma_resolve_route"))
}

trait TapCause {
    fn tap_cause(self, cause: String) -> Error;
}
impl TapCause for Error {
    fn tap_cause(self, cause: String) -> Error {
        Error::new(self.errno(), format!("{cause}: {}", self.cause()))
            .with_prov_errno(self.prov_errno())
    }
}

fn addr_format_of(a: &SocketAddr) -> AddrFormat {
    match a {
        SocketAddr::V4(_) => AddrFormat::SockaddrIn,
        SocketAddr::V6(_) => AddrFormat::SockaddrIn6,
    }
}

/// `fi_getinfo` for rverbs: `node`/`service` name the peer (or, with `FI_SOURCE`, the local
/// address to listen on); hints filter and narrow the answer. `ENODATA` when nothing matches.
pub fn getinfo(
    node: Option<&str>,
    service: Option<&str>,
    flags: Flags,
    hints: Option<&Info>,
) -> Result<Vec<Info>> {
    let devs = devices()?;
    if devs.is_empty() {
        return Err(no_device_error());
    }
    let default_hints = Info::default();
    let hints = hints.unwrap_or(&default_hints);
    let passive = flags.contains(Flags::SOURCE);
    let named = resolve(node, service, passive)?;
    let (mut src, dst) = if passive {
        (named.or(hints.src_addr), hints.dest_addr)
    } else {
        (hints.src_addr, named.or(hints.dest_addr))
    };

    // Which device: the one rdma_cm routes to the destination, or the one owning the source.
    let only: Option<String> = if let Some(d) = dst.as_ref() {
        let id = resolve_route(src.as_ref(), d)?;
        let ctx = id.context().ok_or_else(|| {
            Error::new(
                errno::ENODATA,
                format!("{d} is not reachable through an RDMA device"),
            )
        })?;
        if src.is_none() {
            src = id.local_addr().map(|mut a| {
                a.set_port(0);
                a
            });
        }
        Some(ctx.name())
    } else if let Some(s) = src.filter(|s| !s.ip().is_unspecified()) {
        let id = CmId::new(None).map_err(os_err("rdma_create_id"))?;
        id.bind_addr(&s)
            .map_err(|e| Error::os(e, "rdma_bind_addr").tap_cause(format!("cannot bind {s}")))?;
        let ctx = id.context().ok_or_else(|| {
            Error::new(
                errno::ENODATA,
                format!("{} is not an address of an RDMA device's netdev", s.ip()),
            )
        })?;
        Some(ctx.name())
    } else {
        None
    };

    let mut out = Vec::new();
    let mut last_reason = String::from("no device matched");
    // An unspecified endpoint type gets RDM first (what most applications want), then MSG;
    // datagrams only when asked for.
    let types: &[EpType] = match hints.ep_attr.ep_type {
        EpType::Unspec => &[EpType::Rdm, EpType::Msg],
        EpType::Rdm => &[EpType::Rdm],
        EpType::Dgram => &[EpType::Dgram],
        _ => &[EpType::Msg],
    };
    for (dev, &ep_type) in devs
        .iter()
        .filter(|d| only.as_ref().is_none_or(|n| n == &d.name))
        .flat_map(|d| types.iter().map(move |t| (d, t)))
    {
        let dgram = ep_type == EpType::Dgram;
        let rdm = ep_type == EpType::Rdm;
        let mut info = if dgram {
            dgram_info(dev)?
        } else if rdm {
            let mut i = rdm_info(dev)?;
            without_rma_unless_asked(&mut i, hints, MrMode::empty());
            without_rma_event_unless_asked(&mut i, hints);
            i
        } else {
            let mut i = msg_info(dev)?;
            without_rma_unless_asked(&mut i, hints, MrMode::LOCAL);
            i
        };
        allocated_if_accepted(&mut info, hints);
        if rdm {
            // RDM names come from fi_getname (RdmName), not from IP addresses; a node and a
            // service name a listener (a server started at a well-known port): the answer's
            // destination is then a name with that address alone, which `fi_av_insert` takes.
            info.src_addr = src.or_else(|| dev.ipv4.map(|ip| SocketAddr::new(IpAddr::V4(ip), 0)));
            info.dest_addr = None;
            // Such a name cannot say whether the server counts RMA that targets it
            // (`FI_RMA_EVENT`): a client that asks for it takes it that its server does.
            let rma_event = (hints.caps | hints.rx_attr.caps).contains(Flags::RMA_EVENT);
            info.dest_name = hints.dest_name.clone().or_else(|| {
                dst.filter(|d| d.port() != 0).map(|d| {
                    let n = RdmName {
                        rma_event,
                        ..RdmName::listener(d)
                    };
                    n.to_bytes().to_vec()
                })
            });
        } else if dgram {
            // Datagram names are FI_ADDR_IB_UD (fi_getname, fi_av_insert): an IP address
            // here would be read as one.
            info.src_addr = None;
            info.dest_addr = None;
        } else {
            info.src_addr = src.or_else(|| dev.ipv4.map(|ip| SocketAddr::new(IpAddr::V4(ip), 0)));
            info.dest_addr = dst;
        }
        if let Some(a) = info
            .dest_addr
            .as_ref()
            .or(info.src_addr.as_ref())
            .filter(|_| !dgram && !rdm)
        {
            info.addr_format = addr_format_of(a);
        }
        if let Some(why) = info.mismatch(hints) {
            crate::fi_info!("core", "{}: {}", dev.name, why);
            last_reason = format!("{}: {why}", dev.name);
            continue;
        }
        let mut n = info.narrowed(hints);
        let default_tx = env::get_usize_or("FI_RVERBS_TX_SIZE", 384)?;
        let default_rx = env::get_usize_or("FI_RVERBS_RX_SIZE", 384)?;
        if hints.tx_attr.size == 0 {
            n.tx_attr.size = default_tx.min(info.tx_attr.size).max(1);
        }
        if hints.rx_attr.size == 0 {
            n.rx_attr.size = default_rx.min(info.rx_attr.size).max(1);
        }
        if hints.domain_attr.data_progress == Progress::Unspec {
            n.domain_attr.data_progress = Progress::Manual;
        }
        if dgram && hints.caps.is_empty() {
            n.caps -= Flags::MULTICAST | Flags::SOURCE | Flags::SOURCE_ERR;
        }
        // Echoed to an application that says it handles it (verbs' `vrb_alter_info`).
        if n.rx_attr.mode.contains(Mode::RX_CQ_DATA) && hints.mode.contains(Mode::RX_CQ_DATA) {
            n.mode |= Mode::RX_CQ_DATA;
        }
        // Prefix mode is the application's choice: with it, the GRH lands in its buffers.
        if dgram && hints.mode.contains(Mode::MSG_PREFIX) {
            n.mode |= Mode::MSG_PREFIX;
            // Applications (fi_pingpong among them) look for it in the tx/rx modes too.
            n.tx_attr.mode |= Mode::MSG_PREFIX;
            n.rx_attr.mode |= Mode::MSG_PREFIX;
            n.ep_attr.msg_prefix_size = DGRAM_PREFIX;
        }
        out.push(n);
    }
    if out.is_empty() {
        return Err(Error::new(
            errno::ENODATA,
            format!("no rverbs interface matches the hints ({last_reason})"),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod inline_tests {
    use super::*;

    #[test]
    fn an_inline_size_past_what_verbs_carries_is_refused() {
        assert_eq!(checked_inline(None, 512).unwrap(), 512);
        assert_eq!(checked_inline(Some(0), 512).unwrap(), 0);
        assert_eq!(
            checked_inline(Some(1 << 32), 512).unwrap_err().errno(),
            errno::EINVAL
        );
        assert!(checked_inline(Some(MAX_INLINE + 1), 512).is_err());
    }
}
