//! Device tests: datagram endpoints on UD queue pairs, with and without FI_MSG_PREFIX.
//! On the host without a device they skip; in the VM (`RFABRIC_REQUIRE_DEVICE=1`) they fail.

mod common;

use std::sync::Arc;

use common::*;
use rfabric::verbs::*;
use rfabric::*;

/// The first device's DGRAM info, asking for prefix mode or not.
fn dgram_info(prefix: bool) -> Option<Info> {
    device_info()?;
    let mut hints = Info::default();
    hints.ep_attr.ep_type = EpType::Dgram;
    if prefix {
        hints.mode = Mode::MSG_PREFIX;
    }
    Some(
        getinfo(None, None, Flags::empty(), Some(&hints))
            .unwrap()
            .remove(0),
    )
}

/// Two enabled endpoints in one domain, each with its CQ, and one AV holding both names.
struct Pair {
    domain: Arc<Domain>,
    av: Arc<AddressVector>,
    a: DgramEndpoint,
    b: DgramEndpoint,
    a_cq: Arc<CompletionQueue>,
    b_cq: Arc<CompletionQueue>,
    /// The AV addresses of a and b.
    to_a: u64,
    to_b: u64,
}

fn pair(info: &Info, av_type: AvType) -> Pair {
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, info).unwrap();
    let av = AddressVector::open(&domain, &AvAttr { av_type, count: 4 }).unwrap();
    let mk = || {
        let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
        let ep = DgramEndpoint::open(&domain, info).unwrap();
        ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
        ep.bind_av(&av).unwrap();
        ep.enable().unwrap();
        (ep, cq)
    };
    let (a, a_cq) = mk();
    let (b, b_cq) = mk();
    let to_a = av.insert(&a.getname().unwrap().to_bytes()).unwrap();
    let to_b = av.insert(&b.getname().unwrap().to_bytes()).unwrap();
    Pair {
        domain,
        av,
        a,
        b,
        a_cq,
        b_cq,
        to_a,
        to_b,
    }
}

#[test]
fn getinfo_offers_datagrams_of_one_mtu_with_the_prefix_optional() {
    let Some(plain) = dgram_info(false) else {
        return;
    };
    let prefixed = dgram_info(true).unwrap();
    let dev = &devices().unwrap()[0];
    assert_eq!(plain.ep_attr.ep_type, EpType::Dgram);
    assert_eq!(plain.ep_attr.max_msg_size, dev.port.active_mtu as usize);
    assert_eq!(plain.addr_format, AddrFormat::IbUd);
    assert!(
        !plain.mode.contains(Mode::MSG_PREFIX),
        "rverbs never insists on the prefix"
    );
    assert_eq!(plain.ep_attr.msg_prefix_size, 0);
    assert!(prefixed.mode.contains(Mode::MSG_PREFIX));
    assert_eq!(prefixed.ep_attr.msg_prefix_size, 40);
}

/// Sends every size from 0 to the MTU from a to b (receive posted first), bytes checked.
fn every_size(p: &Pair, prefix: usize) {
    let mtu = p.a.max_msg_size();
    let tx = MemoryRegion::alloc(&p.domain, mtu + prefix, Flags::SEND).unwrap();
    let rx = MemoryRegion::alloc(&p.domain, mtu + prefix + 64, Flags::RECV).unwrap();
    for n in 0..=mtu {
        let data = pattern(n, (n % 251) as u8);
        tx.write_at(prefix, &data).unwrap();
        rx.fill(0, mtu + prefix + 64, 0xcc).unwrap();
        p.b.recv(&rx, 0, mtu + prefix + 64, 1000 + n as u64)
            .unwrap();
        p.a.send(&tx, 0, prefix + n, p.to_b, n as u64).unwrap();
        assert_eq!(wait_one(&p.a_cq).op_context, n as u64);
        let e = wait_one(&p.b_cq);
        assert_eq!(e.op_context, 1000 + n as u64);
        assert_eq!(
            e.len,
            prefix + n,
            "size {n}: the reported length counts the prefix only in prefix mode"
        );
        let mut got = vec![0u8; n + 1];
        rx.read_at(prefix, &mut got).unwrap();
        assert!(got[..n] == data[..], "size {n}: bytes");
        assert_eq!(got[n], 0xcc, "size {n}: nothing past the datagram");
    }
}

#[test]
fn every_size_to_the_mtu_arrives_whole_without_a_prefix() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    assert_eq!(p.a.prefix_size(), 0);
    every_size(&p, 0);
}

#[test]
fn every_size_to_the_mtu_arrives_whole_with_the_prefix() {
    let Some(info) = dgram_info(true) else { return };
    let p = pair(&info, AvType::Map);
    assert_eq!(p.a.prefix_size(), 40);
    every_size(&p, 40);
    // Prefix mode needs the room: shorter buffers are refused.
    let m = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    assert_eq!(p.b.recv(&m, 0, 39, 1).unwrap_err().errno(), errno::EINVAL);
    assert_eq!(
        p.a.send(&m, 0, 39, p.to_b, 1).unwrap_err().errno(),
        errno::EINVAL
    );
}

#[test]
fn inject_remote_cq_data_and_both_directions() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let rx = MemoryRegion::alloc(&p.domain, 4096, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 4096, Flags::SEND).unwrap();
    p.b.recv(&rx, 0, 2048, 1).unwrap();
    p.b.recv(&rx, 2048, 2048, 2).unwrap();
    p.a.inject(b"injected", p.to_b).unwrap();
    p.a.injectdata(b"with data", 0xfeed, p.to_b).unwrap();
    let e = wait_one(&p.b_cq);
    assert_eq!((e.op_context, e.len), (1, 8));
    let e = wait_one(&p.b_cq);
    assert_eq!((e.op_context, e.len, e.data), (2, 9, 0xfeed));
    assert!(Flags::from_bits_retain(e.flags).contains(Flags::REMOTE_CQ_DATA));
    let mut got = [0u8; 9];
    rx.read_at(2048, &mut got).unwrap();
    assert_eq!(&got, b"with data");
    // b answers a, with senddata.
    p.a.recv(&rx, 0, 2048, 3).unwrap();
    tx.write_at(0, b"reply").unwrap();
    p.b.senddata(&tx, 0, 5, 7, p.to_a, 4).unwrap();
    assert_eq!(wait_one(&p.b_cq).op_context, 4);
    let e = wait_one(&p.a_cq);
    assert_eq!((e.op_context, e.len, e.data), (3, 5, 7));
    // Too big for a datagram, or for inject.
    let big = MemoryRegion::alloc(&p.domain, 8192, Flags::SEND).unwrap();
    let mtu = p.a.max_msg_size();
    assert_eq!(
        p.a.send(&big, 0, mtu + 1, p.to_b, 1).unwrap_err().errno(),
        errno::EMSGSIZE
    );
    let too_long = vec![0u8; p.a.inject_size() + 1];
    assert_eq!(
        p.a.inject(&too_long, p.to_b).unwrap_err().errno(),
        errno::EINVAL
    );
}

#[test]
fn address_vector_misuse_returns_errors() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let p = pair(&info, AvType::Map);
    let tx = MemoryRegion::alloc(&p.domain, 64, Flags::SEND).unwrap();
    // A name of the wrong size, an address never inserted, one removed.
    assert_eq!(p.av.insert(&[0u8; 7]).unwrap_err().errno(), errno::EINVAL);
    assert_eq!(
        p.a.send(&tx, 0, 8, 0xdead, 1).unwrap_err().errno(),
        errno::EINVAL
    );
    let name = p.b.getname().unwrap();
    let extra = p.av.insert(&name.to_bytes()).unwrap();
    p.av.remove(extra).unwrap();
    assert_eq!(
        p.a.send(&tx, 0, 8, extra, 1).unwrap_err().errno(),
        errno::EINVAL
    );
    assert_eq!(p.av.remove(extra).unwrap_err().errno(), errno::EINVAL);
    // lookup follows the addrlen rules; straddr names the parts.
    let mut buf = [0u8; 64];
    let mut len = 10;
    assert_eq!(
        p.av.lookup(p.to_b, &mut buf, &mut len).unwrap_err().errno(),
        errno::ETOOSMALL
    );
    assert_eq!(len, UdName::LEN);
    p.av.lookup(p.to_b, &mut buf, &mut len).unwrap();
    assert_eq!(UdName::parse(&buf[..len]).unwrap(), name);
    let s = AddressVector::straddr(&name.to_bytes()).unwrap();
    assert!(
        s.starts_with("fi_addr_ib_ud://") && s.contains(&format!("{:#x}", name.qpn)),
        "{s}"
    );
    // The endpoint still works after the misuse.
    let rx = MemoryRegion::alloc(&p.domain, 64, Flags::RECV).unwrap();
    p.b.recv(&rx, 0, 64, 9).unwrap();
    p.a.inject(b"ok", p.to_b).unwrap();
    assert_eq!(wait_one(&p.b_cq).op_context, 9);
    // An endpoint without an AV cannot be enabled.
    let ep = DgramEndpoint::open(&p.domain, &info).unwrap();
    ep.bind_cq(&p.a_cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    assert_eq!(ep.enable().unwrap_err().errno(), errno::ENOAV);
}
