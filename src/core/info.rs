//! `fi_info` as Rust data, and the hint matching `fi_getinfo(3)` performs for any transport.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;

use rfabric_sys::fabric as fi;

use crate::core::flags::*;

/// A provider-specific handle carried in `fi_info.handle` (a connection request on MSG).
pub type Handle = Arc<dyn Any + Send + Sync>;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TxAttr {
    pub caps: Flags,
    pub mode: Mode,
    pub op_flags: Flags,
    pub msg_order: u64,
    pub comp_order: u64,
    pub inject_size: usize,
    pub size: usize,
    pub iov_limit: usize,
    pub rma_iov_limit: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RxAttr {
    pub caps: Flags,
    pub mode: Mode,
    pub op_flags: Flags,
    pub msg_order: u64,
    pub comp_order: u64,
    pub total_buffered_recv: usize,
    pub size: usize,
    pub iov_limit: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EpAttr {
    pub ep_type: EpType,
    pub protocol: u32,
    pub protocol_version: u32,
    pub max_msg_size: usize,
    pub msg_prefix_size: usize,
    pub max_order_raw_size: usize,
    pub max_order_war_size: usize,
    pub max_order_waw_size: usize,
    /// Tag bits of tagged endpoints (`FI_TAG_GENERIC`-style layout); 0 without `FI_TAGGED`.
    pub mem_tag_format: u64,
    pub tx_ctx_cnt: usize,
    pub rx_ctx_cnt: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DomainAttr {
    pub name: String,
    pub threading: Threading,
    pub control_progress: Progress,
    pub data_progress: Progress,
    pub resource_mgmt: ResourceMgmt,
    pub av_type: AvType,
    pub mr_mode: MrMode,
    pub mr_key_size: usize,
    pub cq_data_size: usize,
    pub cq_cnt: usize,
    pub ep_cnt: usize,
    pub tx_ctx_cnt: usize,
    pub rx_ctx_cnt: usize,
    pub max_ep_tx_ctx: usize,
    pub max_ep_rx_ctx: usize,
    pub max_ep_stx_ctx: usize,
    pub max_ep_srx_ctx: usize,
    pub cntr_cnt: usize,
    pub mr_iov_limit: usize,
    pub caps: Flags,
    pub mode: Mode,
    pub max_err_data: usize,
    pub mr_cnt: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FabricAttr {
    pub name: String,
    pub prov_name: String,
    pub prov_version: u32,
    pub api_version: u32,
}

/// One fabric interface: what `fi_getinfo` returns and what hints are written in.
#[derive(Clone, Debug, Default)]
pub struct Info {
    pub caps: Flags,
    pub mode: Mode,
    pub addr_format: AddrFormat,
    pub src_addr: Option<SocketAddr>,
    pub dest_addr: Option<SocketAddr>,
    /// A destination in the provider's own format (`FI_FORMAT_UNSPEC`): an RDM endpoint's
    /// name, as `fi_getname` gave it (an application copies a peer's into its hints and
    /// inserts the answer's into its AV).
    pub dest_name: Option<Vec<u8>>,
    pub handle: Option<Handle>,
    pub tx_attr: TxAttr,
    pub rx_attr: RxAttr,
    pub ep_attr: EpAttr,
    pub domain_attr: DomainAttr,
    pub fabric_attr: FabricAttr,
}

/// `FI_ORDER_*` bits an RC queue pair guarantees between operations of one endpoint.
pub const RC_MSG_ORDER: u64 = fi::FI_ORDER_RAR
    | fi::FI_ORDER_RAW
    | fi::FI_ORDER_RAS
    | fi::FI_ORDER_WAW
    | fi::FI_ORDER_WAS
    | fi::FI_ORDER_SAW
    | fi::FI_ORDER_SAS;

/// `FI_MR_BASIC`, the pre-1.5 mode value (an enumerator, not a bit).
const MR_BASIC: u32 = fi::FI_MR_BASIC;
/// `FI_MR_SCALABLE`, the pre-1.5 mode value.
const MR_SCALABLE: u32 = fi::FI_MR_SCALABLE;

/// The mr_mode bits an application's hints accept, with the old enumerators expanded.
pub fn hinted_mr_mode(hints: &Info) -> Option<MrMode> {
    let raw = hints.domain_attr.mr_mode.bits();
    if raw == 0 {
        return None; // FI_MR_UNSPEC: the provider chooses.
    }
    if raw == MR_BASIC {
        let mut m = MrMode::VIRT_ADDR | MrMode::ALLOCATED | MrMode::PROV_KEY;
        if hints.mode.contains(Mode::LOCAL_MR) || hints.domain_attr.mode.contains(Mode::LOCAL_MR) {
            m |= MrMode::LOCAL;
        }
        return Some(m);
    }
    if raw == MR_SCALABLE {
        return Some(MrMode::empty());
    }
    Some(MrMode::from_bits_retain(raw))
}

fn name_mismatch(hint: &str, ours: &str) -> bool {
    !hint.is_empty() && hint != ours
}

/// A transmit or receive attribute's caps: those its hints ask for, else its primary caps
/// the info's caps ask for (with the directions the info's `FI_MSG`/`FI_TAGGED` (`dir`) and
/// `FI_RMA` imply), plus the secondary ones it offers. As libfabric's `ofi_alter_info`: a receive
/// side that reported `FI_DIRECTED_RECV` unasked would filter by source an application
/// that never meant to (fabtests' `fi_av_xfer` reposts from a removed address).
fn attr_caps(info_caps: Flags, hinted: Flags, offered: Flags, dir: Flags) -> Flags {
    if !hinted.is_empty() {
        return hinted;
    }
    let mut caps = (info_caps & offered & PRIMARY_CAPS) | (offered - PRIMARY_CAPS);
    if caps.intersects(Flags::MSG | Flags::TAGGED) {
        caps |= offered & dir;
    }
    let rma_dir = RMA_CAPS - Flags::RMA;
    if caps.intersects(Flags::RMA | Flags::ATOMIC) && !caps.intersects(rma_dir) {
        caps |= offered & rma_dir;
    }
    caps
}

impl Info {
    /// Why this provider info cannot satisfy `hints`, or `None` when it can.
    pub fn mismatch(&self, hints: &Info) -> Option<String> {
        let h = hints;
        if h.ep_attr.ep_type != EpType::Unspec && h.ep_attr.ep_type != self.ep_attr.ep_type {
            return Some(format!(
                "endpoint type {:?} requested, {:?} offered",
                h.ep_attr.ep_type, self.ep_attr.ep_type
            ));
        }
        let missing = h.caps - self.caps;
        if !missing.is_empty() {
            return Some(format!("capabilities {missing:?} not supported"));
        }
        if let Some(why) = self.ctx_mismatch(h) {
            return Some(why);
        }
        let tx_missing = h.tx_attr.caps - self.tx_attr.caps;
        let rx_missing = h.rx_attr.caps - self.rx_attr.caps;
        if !tx_missing.is_empty() || !rx_missing.is_empty() {
            return Some(format!(
                "tx caps {tx_missing:?} / rx caps {rx_missing:?} not supported"
            ));
        }
        let need = self.mode - h.mode;
        if !h.mode.is_empty() && !need.is_empty() {
            return Some(format!(
                "mode bits {need:?} required but not accepted by the application"
            ));
        }
        match (h.addr_format, self.addr_format) {
            (AddrFormat::Unspec, _) => {}
            (AddrFormat::Sockaddr, AddrFormat::SockaddrIn | AddrFormat::SockaddrIn6) => {}
            (a, b) if a == b => {}
            (a, b) => return Some(format!("address format {a:?} requested, {b:?} offered")),
        }
        if name_mismatch(&h.domain_attr.name, &self.domain_attr.name) {
            return Some(format!(
                "domain {:?} requested, this is {:?}",
                h.domain_attr.name, self.domain_attr.name
            ));
        }
        if name_mismatch(&h.fabric_attr.name, &self.fabric_attr.name) {
            return Some(format!(
                "fabric {:?} requested, this is {:?}",
                h.fabric_attr.name, self.fabric_attr.name
            ));
        }
        if name_mismatch(&h.fabric_attr.prov_name, &self.fabric_attr.prov_name) {
            return Some(format!("provider {:?} requested", h.fabric_attr.prov_name));
        }
        if let Some(accepted) = hinted_mr_mode(h) {
            let need = self.domain_attr.mr_mode - accepted;
            if !need.is_empty() {
                return Some(format!(
                    "mr_mode {need:?} required but not accepted by the application"
                ));
            }
        }
        if h.domain_attr.data_progress == Progress::Auto
            && self.domain_attr.data_progress == Progress::Manual
        {
            return Some(
                "FI_PROGRESS_AUTO data progress requested; rverbs progresses in fi_cq_read".into(),
            );
        }
        let limits = [
            ("tx_attr.size", h.tx_attr.size, self.tx_attr.size),
            ("rx_attr.size", h.rx_attr.size, self.rx_attr.size),
            (
                "tx_attr.iov_limit",
                h.tx_attr.iov_limit,
                self.tx_attr.iov_limit,
            ),
            (
                "rx_attr.iov_limit",
                h.rx_attr.iov_limit,
                self.rx_attr.iov_limit,
            ),
            (
                "tx_attr.inject_size",
                h.tx_attr.inject_size,
                self.tx_attr.inject_size,
            ),
            (
                "ep_attr.max_msg_size",
                h.ep_attr.max_msg_size,
                self.ep_attr.max_msg_size,
            ),
            (
                "domain_attr.cq_data_size",
                h.domain_attr.cq_data_size,
                self.domain_attr.cq_data_size,
            ),
        ];
        for (what, asked, max) in limits {
            if asked > max {
                return Some(format!("{what} {asked} requested, at most {max} offered"));
            }
        }
        let order = h.tx_attr.msg_order & !self.tx_attr.msg_order;
        if order != 0 {
            return Some(format!("tx_attr.msg_order bits {order:#x} not guaranteed"));
        }
        let order = h.rx_attr.msg_order & !self.rx_attr.msg_order;
        if order != 0 {
            return Some(format!("rx_attr.msg_order bits {order:#x} not guaranteed"));
        }
        let domain_caps = Flags::LOCAL_COMM | Flags::REMOTE_COMM | Flags::SHARED_AV;
        let missing = (h.domain_attr.caps & domain_caps) - self.domain_attr.caps;
        if !missing.is_empty() {
            return Some(format!("domain capabilities {missing:?} not supported"));
        }
        None
    }

    /// Contexts per endpoint (`fi_endpoint(3)`), checked as libfabric's own providers do
    /// (`ofi_check_ep_attr`): a shared context (`FI_SHARED_CONTEXT`) only where the domain
    /// offers one per endpoint (`max_ep_stx_ctx`, `max_ep_srx_ctx`), and no more contexts
    /// than an endpoint has (no scalable endpoints).
    fn ctx_mismatch(&self, h: &Info) -> Option<String> {
        const SHARED: usize = rfabric_sys::fabric::FI_SHARED_CONTEXT;
        let (tx, rx) = (h.ep_attr.tx_ctx_cnt, h.ep_attr.rx_ctx_cnt);
        let d = &self.domain_attr;
        if tx == SHARED && d.max_ep_stx_ctx == 0 {
            return Some("shared transmit contexts (fi_stx_context) are not supported".into());
        }
        if rx == SHARED && d.max_ep_srx_ctx == 0 {
            return Some(format!(
                "shared receive contexts (fi_srx_context) are not offered on {:?} endpoints",
                self.ep_attr.ep_type
            ));
        }
        let over = |asked: usize, most: usize| asked != SHARED && asked > most.max(1);
        if over(tx, self.ep_attr.tx_ctx_cnt) || over(rx, self.ep_attr.rx_ctx_cnt) {
            return Some(format!(
                "{tx} transmit and {rx} receive contexts per endpoint requested: scalable endpoints are not supported"
            ));
        }
        None
    }

    /// This info narrowed to what `hints` asked for (sizes, caps, threading, progress).
    pub fn narrowed(&self, hints: &Info) -> Info {
        let mut i = self.clone();
        let h = hints;
        if !h.caps.is_empty() {
            i.caps = h.caps;
        }
        i.tx_attr.caps = attr_caps(i.caps, h.tx_attr.caps, self.tx_attr.caps, Flags::SEND);
        i.rx_attr.caps = attr_caps(i.caps, h.rx_attr.caps, self.rx_attr.caps, Flags::RECV);
        let pick = |asked: usize, ours: &mut usize| {
            if asked != 0 {
                *ours = asked;
            }
        };
        pick(h.tx_attr.size, &mut i.tx_attr.size);
        pick(h.rx_attr.size, &mut i.rx_attr.size);
        pick(h.tx_attr.iov_limit, &mut i.tx_attr.iov_limit);
        pick(h.rx_attr.iov_limit, &mut i.rx_attr.iov_limit);
        pick(h.tx_attr.inject_size, &mut i.tx_attr.inject_size);
        // `FI_SHARED_CONTEXT` asked (and offered: `mismatch`) is echoed.
        pick(h.ep_attr.tx_ctx_cnt, &mut i.ep_attr.tx_ctx_cnt);
        pick(h.ep_attr.rx_ctx_cnt, &mut i.ep_attr.rx_ctx_cnt);
        i.tx_attr.op_flags = h.tx_attr.op_flags;
        i.rx_attr.op_flags = h.rx_attr.op_flags;
        if h.domain_attr.threading != Threading::Unspec {
            i.domain_attr.threading = h.domain_attr.threading;
        }
        if h.domain_attr.control_progress != Progress::Unspec {
            i.domain_attr.control_progress = h.domain_attr.control_progress;
        }
        if h.domain_attr.resource_mgmt != ResourceMgmt::Unspec {
            i.domain_attr.resource_mgmt = h.domain_attr.resource_mgmt;
        }
        // An application that speaks the old enumerators (`FI_MR_BASIC`, `FI_MR_SCALABLE`)
        // gets its own back, as libfabric's providers answer (`mismatch` checked that this
        // info needs no more than it means).
        let raw = h.domain_attr.mr_mode.bits();
        if raw == MR_BASIC || raw == MR_SCALABLE {
            i.domain_attr.mr_mode = h.domain_attr.mr_mode;
        }
        i
    }
}

/// `FI_VERSION(1, 5)`: the first API whose mr_mode is bits rather than an enumerator.
pub const MR_BITS_API: u32 = (1 << 16) | 5;

/// fi_domain(3)'s mr_mode rules that turn on the caller's API version and on hints that
/// name no mode (`FI_MR_UNSPEC`), as libfabric's own providers apply them
/// (`ofi_check_mr_mode`, `fi_alter_domain_attr`): an info that needs `FI_MR_LOCAL` only
/// for a caller that does local registration (the bit, or the `FI_LOCAL_MR` mode), and a
/// caller of an API before 1.5 answered with the old enumerators (`FI_MR_BASIC` when any
/// bit is needed, with `FI_LOCAL_MR` in the mode for `FI_MR_LOCAL`; else `FI_MR_SCALABLE`).
pub fn api_mr_rules(api: u32, hints: Option<&Info>, infos: &mut Vec<Info>) {
    let local_mr =
        |i: &Info| i.mode.contains(Mode::LOCAL_MR) || i.domain_attr.mode.contains(Mode::LOCAL_MR);
    if let Some(h) = hints.filter(|h| h.domain_attr.mr_mode.is_empty()) {
        let local_ok = local_mr(h);
        infos.retain(|i| local_ok || !i.domain_attr.mr_mode.contains(MrMode::LOCAL));
        if api >= MR_BITS_API {
            // A caller that names no mode bit gets none back (`fi_alter_domain_attr`):
            // RMA, which needs provider keys, only when its caps ask for it; local
            // registration as the FI_LOCAL_MR mode bit, which it set.
            let rma_asked = (h.caps | h.tx_attr.caps | h.rx_attr.caps).intersects(REMOTE_KEY_CAPS);
            for i in infos.iter_mut() {
                if !rma_asked && !(i.domain_attr.mr_mode - MrMode::LOCAL).is_empty() {
                    let rma = REMOTE_KEY_CAPS | Flags::RMA_EVENT;
                    i.caps -= rma;
                    i.tx_attr.caps -= rma;
                    i.rx_attr.caps -= rma;
                    i.domain_attr.mr_mode &= MrMode::LOCAL;
                }
                if i.domain_attr.mr_mode.contains(MrMode::LOCAL) {
                    i.domain_attr.mr_mode -= MrMode::LOCAL;
                    i.mode |= Mode::LOCAL_MR;
                }
            }
        }
    }
    if api >= MR_BITS_API {
        return;
    }
    for i in infos.iter_mut() {
        let m = i.domain_attr.mr_mode;
        let raw = m.bits();
        if raw == MR_BASIC || raw == MR_SCALABLE {
            continue;
        }
        if m.contains(MrMode::LOCAL) {
            i.mode |= Mode::LOCAL_MR;
        }
        let old = if m.is_empty() { MR_SCALABLE } else { MR_BASIC };
        i.domain_attr.mr_mode = MrMode::from_bits_retain(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offered() -> Info {
        let mut i = Info {
            caps: Flags::MSG | Flags::SEND | Flags::RECV,
            addr_format: AddrFormat::SockaddrIn,
            ..Default::default()
        };
        i.tx_attr = TxAttr {
            caps: i.caps,
            size: 1024,
            iov_limit: 4,
            inject_size: 512,
            msg_order: RC_MSG_ORDER,
            ..Default::default()
        };
        i.rx_attr = RxAttr {
            caps: i.caps,
            size: 1024,
            iov_limit: 4,
            ..Default::default()
        };
        i.ep_attr = EpAttr {
            ep_type: EpType::Msg,
            max_msg_size: 1 << 30,
            ..Default::default()
        };
        i.domain_attr.name = "rxe0".into();
        i.domain_attr.mr_mode = MrMode::LOCAL;
        i.domain_attr.caps = Flags::LOCAL_COMM | Flags::REMOTE_COMM;
        i.rx_attr.msg_order = RC_MSG_ORDER;
        i.domain_attr.data_progress = Progress::Manual;
        i.domain_attr.cq_data_size = 4;
        i.fabric_attr = FabricAttr {
            name: "IB-0xfe80000000000000".into(),
            prov_name: "rverbs".into(),
            ..Default::default()
        };
        i
    }

    /// fi_getinfo(3): an answer satisfies the hints bit by bit. Every combination of the
    /// eight mr_mode bits: refused without FI_MR_LOCAL, else answered with bits the
    /// application set only.
    #[test]
    fn every_mr_mode_combination_is_answered_with_offered_bits_only() {
        let bits = [
            MrMode::LOCAL,
            MrMode::RAW,
            MrMode::VIRT_ADDR,
            MrMode::ALLOCATED,
            MrMode::PROV_KEY,
            MrMode::MMU_NOTIFY,
            MrMode::RMA_EVENT,
            MrMode::ENDPOINT,
        ];
        for combo in 1u32..256 {
            let offered_bits = bits
                .iter()
                .enumerate()
                .filter(|(k, _)| combo & (1 << k) != 0)
                .fold(MrMode::empty(), |m, (_, b)| m | *b);
            let mut h = Info::default();
            h.domain_attr.mr_mode = offered_bits;
            let o = offered();
            match o.mismatch(&h) {
                None => {
                    assert!(offered_bits.contains(MrMode::LOCAL), "{offered_bits:?}");
                    let got = o.narrowed(&h).domain_attr.mr_mode;
                    assert!(offered_bits.contains(got), "{got:?} for {offered_bits:?}");
                }
                Some(why) => {
                    assert!(
                        !offered_bits.contains(MrMode::LOCAL),
                        "{offered_bits:?}: {why}"
                    );
                    assert!(why.contains("mr_mode"), "{why}");
                }
            }
        }
    }

    #[test]
    fn every_domain_capability_asked_is_in_the_answer_or_refused() {
        let caps = [Flags::LOCAL_COMM, Flags::REMOTE_COMM, Flags::SHARED_AV];
        for combo in 0u32..8 {
            let asked = caps
                .iter()
                .enumerate()
                .filter(|(k, _)| combo & (1 << k) != 0)
                .fold(Flags::empty(), |m, (_, c)| m | *c);
            let mut h = Info::default();
            h.domain_attr.caps = asked;
            let o = offered();
            match o.mismatch(&h) {
                None => assert!(o.narrowed(&h).domain_attr.caps.contains(asked), "{asked:?}"),
                Some(why) => {
                    assert!(asked.contains(Flags::SHARED_AV), "{asked:?}: {why}");
                }
            }
        }
    }

    #[test]
    fn every_ordering_bit_asked_is_in_the_answer_or_refused() {
        for bit in 0..13 {
            for rx in [false, true] {
                let mut h = Info::default();
                let order = 1u64 << bit;
                if rx {
                    h.rx_attr.msg_order = order;
                } else {
                    h.tx_attr.msg_order = order;
                }
                let o = offered();
                let ours = if rx {
                    o.rx_attr.msg_order
                } else {
                    o.tx_attr.msg_order
                };
                match o.mismatch(&h) {
                    None => assert!(ours & order != 0, "bit {bit:#x} rx {rx}"),
                    Some(why) => {
                        assert!(ours & order == 0, "bit {bit:#x} rx {rx}: {why}");
                        assert!(why.contains("msg_order"), "{why}");
                    }
                }
            }
        }
    }

    #[test]
    fn empty_hints_match() {
        assert_eq!(offered().mismatch(&Info::default()), None);
    }

    #[test]
    fn each_unsatisfiable_hint_is_refused_with_its_reason() {
        let o = offered();
        type SetHint = Box<dyn Fn(&mut Info)>;
        let cases: Vec<(SetHint, &str)> = vec![
            (
                Box::new(|h| h.ep_attr.ep_type = EpType::Rdm),
                "endpoint type",
            ),
            (Box::new(|h| h.caps = Flags::TAGGED), "capabilities"),
            (
                Box::new(|h| h.addr_format = AddrFormat::SockaddrIb),
                "address format",
            ),
            (Box::new(|h| h.domain_attr.name = "mlx5_0".into()), "domain"),
            (
                Box::new(|h| h.fabric_attr.prov_name = "tcp".into()),
                "provider",
            ),
            (
                Box::new(|h| h.domain_attr.mr_mode = MrMode::VIRT_ADDR),
                "mr_mode",
            ),
            (Box::new(|h| h.tx_attr.size = 4096), "tx_attr.size"),
            (Box::new(|h| h.tx_attr.inject_size = 4096), "inject_size"),
            (
                Box::new(|h| h.ep_attr.max_msg_size = usize::MAX),
                "max_msg_size",
            ),
            (Box::new(|h| h.domain_attr.cq_data_size = 8), "cq_data_size"),
            (
                Box::new(|h| h.domain_attr.data_progress = Progress::Auto),
                "FI_PROGRESS_AUTO",
            ),
            (
                Box::new(|h| h.tx_attr.msg_order = fi::FI_ORDER_DATA),
                "msg_order",
            ),
        ];
        for (set, reason) in cases {
            let mut h = Info::default();
            set(&mut h);
            let why = o
                .mismatch(&h)
                .unwrap_or_else(|| panic!("hint for {reason} was accepted"));
            assert!(why.contains(reason), "{why} should mention {reason}");
        }
    }

    #[test]
    fn satisfiable_hints_match_and_narrow_the_answer() {
        let o = offered();
        let mut h = Info {
            caps: Flags::MSG,
            addr_format: AddrFormat::Sockaddr,
            ..Default::default()
        };
        h.ep_attr.ep_type = EpType::Msg;
        h.tx_attr.size = 64;
        h.domain_attr.mr_mode = MrMode::LOCAL
            | MrMode::VIRT_ADDR
            | MrMode::ALLOCATED
            | MrMode::PROV_KEY
            | MrMode::ENDPOINT;
        h.domain_attr.threading = Threading::Domain;
        assert_eq!(o.mismatch(&h), None);
        let n = o.narrowed(&h);
        assert_eq!(
            (n.caps, n.tx_attr.size, n.rx_attr.size),
            (Flags::MSG, 64, 1024)
        );
        assert_eq!(n.domain_attr.threading, Threading::Domain);
    }

    /// fi_getinfo(3): primary capabilities are reported only where asked, in the
    /// transmit and receive attributes too; secondary ones where offered.
    #[test]
    fn attributes_report_the_primary_caps_asked_and_the_secondary_offered() {
        let mut o = offered();
        let rx = Flags::MSG | Flags::TAGGED | Flags::RECV | Flags::DIRECTED_RECV;
        o.caps |= Flags::TAGGED | Flags::DIRECTED_RECV | RMA_CAPS;
        o.rx_attr.caps = rx | Flags::MULTI_RECV | Flags::SOURCE | Flags::RMA;
        o.rx_attr.caps |= Flags::REMOTE_READ | Flags::REMOTE_WRITE;
        o.tx_attr.caps = Flags::MSG | Flags::TAGGED | Flags::SEND | Flags::RMA;
        o.tx_attr.caps |= Flags::READ | Flags::WRITE;
        let ask = |caps: Flags, rx_caps: Flags| {
            let mut h = Info {
                caps,
                ..Default::default()
            };
            h.rx_attr.caps = rx_caps;
            o.narrowed(&h)
        };
        let n = ask(Flags::TAGGED, Flags::empty());
        let secondary = Flags::MULTI_RECV | Flags::SOURCE;
        assert_eq!(n.rx_attr.caps, Flags::TAGGED | Flags::RECV | secondary);
        assert_eq!(n.tx_attr.caps, Flags::TAGGED | Flags::SEND);
        let n = ask(Flags::TAGGED | Flags::DIRECTED_RECV, Flags::empty());
        assert!(n.rx_attr.caps.contains(Flags::DIRECTED_RECV));
        let n = ask(Flags::RMA, Flags::empty());
        assert_eq!(
            n.tx_attr.caps,
            RMA_CAPS - Flags::REMOTE_READ - Flags::REMOTE_WRITE
        );
        assert_eq!(
            n.rx_attr.caps,
            Flags::RMA | Flags::REMOTE_READ | Flags::REMOTE_WRITE | secondary
        );
        assert_eq!(
            ask(Flags::TAGGED, Flags::RECV).rx_attr.caps,
            Flags::RECV,
            "echoed"
        );
        assert_eq!(
            ask(Flags::empty(), Flags::empty()).rx_attr.caps,
            o.rx_attr.caps
        );
    }

    #[test]
    fn mr_basic_means_virt_addr_allocated_prov_key_and_local_with_local_mr_mode() {
        let mut h = Info::default();
        h.domain_attr.mr_mode = MrMode::from_bits_retain(fi::FI_MR_BASIC);
        assert_eq!(
            offered().mismatch(&h).map(|s| s.contains("LOCAL")),
            Some(true)
        );
        h.mode = Mode::LOCAL_MR;
        assert_eq!(offered().mismatch(&h), None);
    }

    /// fi_endpoint(3)'s contexts, as libfabric's providers check them: a shared transmit
    /// context never (no `fi_stx_context`), a shared receive context where the domain
    /// offers one per endpoint (echoed), more than one context per endpoint never.
    #[test]
    fn shared_and_scalable_contexts_are_offered_only_where_they_exist() {
        const SHARED: usize = rfabric_sys::fabric::FI_SHARED_CONTEXT;
        let mut o = offered();
        o.ep_attr.tx_ctx_cnt = 1;
        o.ep_attr.rx_ctx_cnt = 1;
        let mut h = Info::default();
        h.ep_attr.tx_ctx_cnt = SHARED;
        assert!(o.mismatch(&h).unwrap().contains("fi_stx_context"));
        h.ep_attr.tx_ctx_cnt = 0;
        h.ep_attr.rx_ctx_cnt = SHARED;
        assert!(o.mismatch(&h).unwrap().contains("fi_srx_context"));
        o.domain_attr.max_ep_srx_ctx = 1;
        assert_eq!(o.mismatch(&h), None);
        assert_eq!(o.narrowed(&h).ep_attr.rx_ctx_cnt, SHARED);
        h.ep_attr.rx_ctx_cnt = 2;
        assert!(o.mismatch(&h).unwrap().contains("scalable"));
        h.ep_attr.rx_ctx_cnt = 1;
        h.ep_attr.tx_ctx_cnt = 1;
        assert_eq!(o.mismatch(&h), None);
    }

    /// The mr_mode rules that depend on the API version and on `FI_MR_UNSPEC` hints
    /// (`ofi_check_mr_mode`, `fi_alter_domain_attr`), as fabtests' getinfo test checks them.
    #[test]
    fn old_mr_enumerators_and_unspecified_modes_are_answered_as_libfabric_does() {
        let local = offered();
        let mut plain = offered();
        plain.domain_attr.mr_mode = MrMode::empty();
        let mut keyed = offered();
        keyed.domain_attr.mr_mode = MrMode::PROV_KEY | MrMode::VIRT_ADDR;
        let all = || vec![local.clone(), plain.clone(), keyed.clone()];
        // FI_MR_UNSPEC hints: what needs FI_MR_LOCAL only with the FI_LOCAL_MR mode.
        let mut h = Info::default();
        let mut v = all();
        api_mr_rules(rfabric_sys::fabric::RFABRIC_FI_VERSION, Some(&h), &mut v);
        assert_eq!(v.len(), 2);
        assert!(v
            .iter()
            .all(|i| !i.domain_attr.mr_mode.contains(MrMode::LOCAL)));
        h.mode = Mode::LOCAL_MR;
        let mut v = all();
        api_mr_rules(rfabric_sys::fabric::RFABRIC_FI_VERSION, Some(&h), &mut v);
        assert_eq!(v.len(), 3);
        // Answered with no bit the caller did not name: FI_MR_LOCAL as the FI_LOCAL_MR mode,
        // provider keys (RMA) only for a caller whose caps ask for RMA.
        assert!(v.iter().all(|i| i.domain_attr.mr_mode.is_empty()));
        assert!(v[0].mode.contains(Mode::LOCAL_MR));
        // An API before 1.5 reads the old enumerators, FI_MR_LOCAL as the FI_LOCAL_MR mode.
        let mut v = all();
        api_mr_rules(1 << 16, Some(&h), &mut v);
        let modes: Vec<u32> = v.iter().map(|i| i.domain_attr.mr_mode.bits()).collect();
        assert_eq!(modes, [MR_BASIC, MR_SCALABLE, MR_BASIC]);
        assert!(v[0].mode.contains(Mode::LOCAL_MR));
        assert!(!v[2].mode.contains(Mode::LOCAL_MR));
        // FI_MR_BASIC asked: answered as asked, where the info needs no more than it means.
        h.mode = Mode::empty();
        h.domain_attr.mr_mode = MrMode::from_bits_retain(MR_BASIC);
        assert!(local.mismatch(&h).is_some());
        assert_eq!(keyed.mismatch(&h), None);
        assert_eq!(keyed.narrowed(&h).domain_attr.mr_mode.bits(), MR_BASIC);
        h.domain_attr.mr_mode = MrMode::from_bits_retain(MR_SCALABLE);
        assert!(keyed.mismatch(&h).is_some());
        assert_eq!(plain.narrowed(&h).domain_attr.mr_mode.bits(), MR_SCALABLE);
    }
}
