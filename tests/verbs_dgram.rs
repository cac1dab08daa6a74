//! Device tests: datagram endpoints on UD queue pairs, with and without FI_MSG_PREFIX.
//! On the host without a device they skip; in the VM (`RFABRIC_REQUIRE_DEVICE=1`) they fail.

mod common;

use std::sync::Arc;

use common::*;
use rfabric::verbs::*;
use rfabric::*;

/// The first device's DGRAM info, asking for prefix mode or not.
fn dgram_info(prefix: bool) -> Option<Info> {
    dgram_info_caps(prefix, Flags::empty())
}

/// As `dgram_info`, asking for `caps` too.
fn dgram_info_caps(prefix: bool, caps: Flags) -> Option<Info> {
    device_info()?;
    let mut hints = Info::default();
    hints.ep_attr.ep_type = EpType::Dgram;
    hints.caps = caps;
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
    a: Arc<DgramEndpoint>,
    b: Arc<DgramEndpoint>,
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

/// Reads one completion with its source address, polling up to 10 s.
fn wait_from(cq: &CompletionQueue) -> (rfabric::core::cq::CqEntry, u64) {
    let mut out = [rfabric::core::cq::CqEntry::default(); 1];
    let mut src = [0u64; 1];
    let start = std::time::Instant::now();
    loop {
        match cq.readfrom(&mut out, &mut src) {
            Ok(1) => return (out[0], src[0]),
            Ok(_) => {}
            Err(e) if e.is_again() => {}
            Err(e) => panic!("cq readfrom: {e} {:?}", cq.readerr()),
        }
        assert!(start.elapsed().as_secs() < 10, "no completion within 10 s");
    }
}

fn fi_source_maps_senders_back_to_their_addresses(prefix: bool) {
    let caps = Flags::MSG | Flags::SEND | Flags::RECV | Flags::SOURCE;
    let Some(info) = dgram_info_caps(prefix, caps) else {
        return;
    };
    assert!(info.caps.contains(Flags::SOURCE));
    let p = pair(&info, AvType::Map);
    let pre = p.a.prefix_size();
    let rx = MemoryRegion::alloc(&p.domain, 64 * 1024, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 4096, Flags::SEND).unwrap();
    // A third endpoint sends too, but is not in the AV.
    let c = DgramEndpoint::open(&p.domain, &info).unwrap();
    let c_cq = CompletionQueue::open(&p.domain, &CqAttr::default()).unwrap();
    c.bind_cq(&c_cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    c.bind_av(&p.av).unwrap();
    c.enable().unwrap();
    for i in 0..6 {
        p.b.recv(&rx, i * 2048, 2048, 10 + i as u64).unwrap();
    }
    // Interleaved senders: each completion names its own.
    let senders = [
        (&p.a, &p.a_cq, Some(p.to_a)),
        (&c, &c_cq, None),
        (&p.a, &p.a_cq, Some(p.to_a)),
        (&c, &c_cq, None),
    ];
    for (i, (ep, cq, _)) in senders.iter().enumerate() {
        tx.write_at(pre, &[i as u8; 8]).unwrap();
        ep.send(&tx, 0, pre + 8, p.to_b, i as u64).unwrap();
        assert_eq!(wait_one(cq).op_context, i as u64);
        let (e, from) = wait_from(&p.b_cq);
        assert_eq!(e.op_context, 10 + i as u64);
        assert_eq!(
            from,
            senders[i]
                .2
                .unwrap_or(rfabric_sys::fabric::FI_ADDR_NOTAVAIL),
            "datagram {i}: source"
        );
    }
    // b answers a: a's completion names b.
    p.a.recv(&rx, 40000, 2048, 99).unwrap();
    p.b.inject(&vec![7u8; pre + 4], p.to_a).unwrap();
    let (e, from) = wait_from(&p.a_cq);
    assert_eq!((e.op_context, from), (99, p.to_b));
}

#[test]
fn fi_source_maps_senders_back_to_their_addresses_without_a_prefix() {
    fi_source_maps_senders_back_to_their_addresses(false);
}

#[test]
fn fi_source_maps_senders_back_to_their_addresses_with_the_prefix() {
    fi_source_maps_senders_back_to_their_addresses(true);
}

#[test]
fn fi_source_err_reports_unknown_senders_with_their_raw_name() {
    let caps = Flags::MSG | Flags::SEND | Flags::RECV | Flags::SOURCE | Flags::SOURCE_ERR;
    let Some(info) = dgram_info_caps(false, caps) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let c = DgramEndpoint::open(&p.domain, &info).unwrap();
    let c_cq = CompletionQueue::open(&p.domain, &CqAttr::default()).unwrap();
    c.bind_cq(&c_cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    c.bind_av(&p.av).unwrap();
    c.enable().unwrap();
    let rx = MemoryRegion::alloc(&p.domain, 8192, Flags::RECV).unwrap();
    p.b.recv(&rx, 0, 2048, 1).unwrap();
    p.b.recv(&rx, 2048, 2048, 2).unwrap();
    c.inject(b"who am i", p.to_b).unwrap();
    let e = wait_err(&p.b_cq);
    assert_eq!((e.op_context, e.err, e.len), (1, errno::EADDRNOTAVAIL, 8));
    assert_eq!(
        e.err_data,
        c.getname().unwrap().to_bytes().to_vec(),
        "the raw source name"
    );
    // A known sender still completes normally.
    p.a.inject(b"known", p.to_b).unwrap();
    let (e, from) = wait_from(&p.b_cq);
    assert_eq!((e.op_context, e.len, from), (2, 5, p.to_a));
}

#[test]
fn a_receive_queue_that_runs_dry_drops_datagrams_and_says_so() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let rx = MemoryRegion::alloc(&p.domain, 4096, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 4096, Flags::SEND).unwrap();
    assert_eq!(p.b.rx_dry_events(), 0);
    p.b.recv(&rx, 0, 2048, 1).unwrap();
    // Two datagrams, one receive: the sender is never held up.
    p.a.send(&tx, 0, 16, p.to_b, 10).unwrap();
    p.a.send(&tx, 0, 16, p.to_b, 11).unwrap();
    assert_eq!(wait_one(&p.a_cq).op_context, 10);
    assert_eq!(wait_one(&p.a_cq).op_context, 11);
    assert_eq!(wait_one(&p.b_cq).op_context, 1);
    assert_eq!(p.b.rx_dry_events(), 1, "the queue ran dry");
    let start = std::time::Instant::now();
    let mut out = [rfabric::core::cq::CqEntry::default(); 1];
    while start.elapsed().as_millis() < 300 {
        match p.b_cq.read(&mut out) {
            Err(e) if e.is_again() => {}
            other => panic!("the second datagram had no receive and must be dropped: {other:?}"),
        }
    }
    // With receives posted again, datagrams arrive again.
    p.b.recv(&rx, 0, 2048, 2).unwrap();
    p.a.send(&tx, 0, 16, p.to_b, 12).unwrap();
    assert_eq!(wait_one(&p.b_cq).op_context, 2);
}

#[test]
fn fi_more_chains_datagrams_until_the_batch_ends() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let rx = MemoryRegion::alloc(&p.domain, 16 * 1024, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 16 * 1024, Flags::SEND).unwrap();
    for i in 0..40 {
        p.b.recv(&rx, i * 256, 256, 100 + i as u64).unwrap();
    }
    for i in 0..3 {
        tx.write_at(i * 64, &[i as u8 + 1; 64]).unwrap();
        p.a.sendmsg(&tx, i * 64, 64, p.to_b, i as u64, 0, Flags::MORE)
            .unwrap();
    }
    // Chained: nothing left the endpoint yet.
    let mut out = [rfabric::core::cq::CqEntry::default(); 4];
    let start = std::time::Instant::now();
    while start.elapsed().as_millis() < 300 {
        for cq in [&p.a_cq, &p.b_cq] {
            match cq.read(&mut out) {
                Err(e) if e.is_again() => {}
                other => panic!("a chained datagram completed before the batch ended: {other:?}"),
            }
        }
    }
    tx.write_at(3 * 64, &[4u8; 64]).unwrap();
    p.a.sendmsg(&tx, 3 * 64, 64, p.to_b, 3, 0, Flags::empty())
        .unwrap();
    for i in 0..4 {
        let e = wait_one(&p.b_cq);
        assert_eq!((e.op_context, e.len), (100 + i as u64, 64));
        let mut got = [0u8; 64];
        rx.read_at(i * 256, &mut got).unwrap();
        assert_eq!(got, [i as u8 + 1; 64], "datagram {i} in order");
        assert_eq!(wait_one(&p.a_cq).op_context, i as u64);
    }
    // Longer than a chain, ended by an inject: all arrive, in order.
    for i in 0..35 {
        p.a.sendmsg(&tx, 0, 8, p.to_b, 1000 + i, 0, Flags::MORE)
            .unwrap();
    }
    p.a.inject(b"last", p.to_b).unwrap();
    for i in 0..36 {
        let e = wait_one(&p.b_cq);
        assert_eq!(e.op_context, 104 + i as u64);
        assert_eq!(e.len, if i == 35 { 4 } else { 8 });
    }
}

/// Waits for `FI_JOIN_COMPLETE` with `fid` on `eq`.
fn wait_join(eq: &EventQueue, fid: u64) {
    match next_event(eq) {
        rfabric::core::eq::EqEvent::JoinComplete { fid: f } => assert_eq!(f, fid),
        other => panic!("expected FI_JOIN_COMPLETE, got {other:?}"),
    }
}

#[test]
fn a_multicast_group_reaches_every_receiver_until_it_leaves() {
    let caps = Flags::MSG | Flags::SEND | Flags::RECV | Flags::MULTICAST;
    let Some(info) = dgram_info_caps(false, caps) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    // A third endpoint, a second receiver.
    let c = DgramEndpoint::open(&p.domain, &info).unwrap();
    let c_cq = CompletionQueue::open(&p.domain, &CqAttr::default()).unwrap();
    c.bind_cq(&c_cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    c.bind_av(&p.av).unwrap();
    for ep in [&p.a, &p.b, &c] {
        ep.bind_eq(&eq).unwrap();
    }
    c.enable().unwrap();
    let group: std::net::SocketAddr = "239.7.7.7:0".parse().unwrap();
    assert_eq!(
        p.a.join(&"192.0.2.9:0".parse().unwrap(), Flags::empty(), 1)
            .unwrap_err()
            .errno(),
        errno::EINVAL,
        "not a multicast address"
    );
    let mb = p.b.join(&group, Flags::RECV, 2).unwrap();
    wait_join(&eq, 2);
    let mc = c.join(&group, Flags::empty(), 3).unwrap();
    wait_join(&eq, 3);
    let ma = p.a.join(&group, Flags::SEND, 4).unwrap();
    wait_join(&eq, 4);
    let to_group = ma.mc_addr().unwrap();
    assert!(mb.mc_addr().is_ok() && mc.mc_addr().is_ok());
    let rx = MemoryRegion::alloc(&p.domain, 8192, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 4096, Flags::SEND).unwrap();
    p.b.recv(&rx, 0, 2048, 10).unwrap();
    c.recv(&rx, 2048, 2048, 20).unwrap();
    p.a.recv(&rx, 4096, 2048, 30).unwrap();
    let msg = pattern(700, 9);
    tx.write_at(0, &msg).unwrap();
    p.a.sendmsg(&tx, 0, msg.len(), to_group, 1, 0, Flags::MULTICAST)
        .unwrap();
    assert_eq!(wait_one(&p.a_cq).op_context, 1);
    for (cq, ctx, off) in [(&p.b_cq, 10, 0), (&c_cq, 20, 2048)] {
        let e = wait_one(cq);
        assert_eq!((e.op_context, e.len), (ctx, msg.len()));
        assert!(
            Flags::from_bits_retain(e.flags).contains(Flags::MULTICAST),
            "received from a group: FI_MULTICAST"
        );
        let mut got = vec![0u8; msg.len()];
        rx.read_at(off, &mut got).unwrap();
        assert!(got == msg, "bytes at receiver {ctx}");
    }
    // A unicast datagram is not flagged FI_MULTICAST.
    p.b.recv(&rx, 0, 2048, 11).unwrap();
    p.a.inject(b"direct", p.to_b).unwrap();
    let e = wait_one(&p.b_cq);
    assert_eq!(e.op_context, 11);
    assert!(!Flags::from_bits_retain(e.flags).contains(Flags::MULTICAST));
    // b leaves: only c receives; a, a send-only member, never did.
    drop(mb);
    p.b.recv(&rx, 0, 2048, 12).unwrap();
    c.recv(&rx, 2048, 2048, 21).unwrap();
    p.a.sendmsg(&tx, 0, 100, to_group, 2, 0, Flags::MULTICAST)
        .unwrap();
    assert_eq!(wait_one(&p.a_cq).op_context, 2);
    assert_eq!(wait_one(&c_cq).op_context, 21);
    let mut out = [rfabric::core::cq::CqEntry::default(); 1];
    let start = std::time::Instant::now();
    while start.elapsed().as_millis() < 300 {
        for cq in [&p.b_cq, &p.a_cq] {
            match cq.read(&mut out) {
                Err(e) if e.is_again() => {}
                other => panic!("a non-member received the group's datagram: {other:?}"),
            }
        }
    }
    drop((ma, mc));
}

#[test]
fn selective_completion_reports_only_the_datagrams_that_ask() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    let av = AddressVector::open(&domain, &AvAttr::default()).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let mk = || {
        let ep = DgramEndpoint::open(&domain, &info).unwrap();
        ep.bind_cq(
            &cq,
            Flags::TRANSMIT | Flags::RECV | Flags::SELECTIVE_COMPLETION,
        )
        .unwrap();
        ep.bind_av(&av).unwrap();
        ep.enable().unwrap();
        ep
    };
    let (a, b) = (mk(), mk());
    let to_b = av.insert(&b.getname().unwrap().to_bytes()).unwrap();
    let rx = MemoryRegion::alloc(&domain, 4096, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&domain, 4096, Flags::SEND).unwrap();
    b.recvmsg(&rx, 0, 1024, 1, Flags::empty()).unwrap();
    b.recvmsg(&rx, 1024, 1024, 2, Flags::COMPLETION).unwrap();
    a.send(&tx, 0, 16, to_b, 10).unwrap();
    a.sendmsg(&tx, 0, 32, to_b, 11, 0, Flags::COMPLETION)
        .unwrap();
    // Only the send and the receive that asked complete, in order.
    let got: Vec<(u64, usize)> = (0..2)
        .map(|_| wait_one(&cq))
        .map(|e| (e.op_context, e.len))
        .collect();
    assert!(got.contains(&(11, 0)) && got.contains(&(2, 32)), "{got:?}");
    let mut out = [rfabric::core::cq::CqEntry::default(); 4];
    let start = std::time::Instant::now();
    while start.elapsed().as_millis() < 200 {
        match cq.read(&mut out) {
            Err(e) if e.is_again() => {}
            other => panic!("a completion nobody asked for: {other:?}"),
        }
    }
}

fn a_datagram_longer_than_its_receive_is_truncated_with_olen(prefix: bool) {
    let Some(info) = dgram_info(prefix) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let pre = p.a.prefix_size();
    let rx = MemoryRegion::alloc(&p.domain, 8192, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 8192, Flags::SEND).unwrap();
    rx.fill(0, 8192, 0xcc).unwrap();
    let msg = pattern(700, 5);
    tx.write_at(pre, &msg).unwrap();
    p.b.recv(&rx, 0, pre + 100, 1).unwrap();
    p.a.send(&tx, 0, pre + msg.len(), p.to_b, 2).unwrap();
    assert_eq!(wait_one(&p.a_cq).op_context, 2);
    let e = wait_err(&p.b_cq);
    assert_eq!(
        (e.op_context, e.err, e.len, e.olen),
        (1, errno::ETRUNC, pre + 100, 600),
        "the first 100 bytes arrive, 600 are reported lost"
    );
    let mut got = vec![0u8; 101];
    rx.read_at(pre, &mut got).unwrap();
    assert!(got[..100] == msg[..100], "the part that fit");
    assert_eq!(got[100], 0xcc, "nothing past the receive");
    // The endpoint goes on: a datagram that fits arrives whole.
    p.b.recv(&rx, 4096, pre + 1024, 3).unwrap();
    p.a.send(&tx, 0, pre + msg.len(), p.to_b, 4).unwrap();
    let e = wait_one(&p.b_cq);
    assert_eq!((e.op_context, e.len), (3, pre + 700));
}

/// A CQ reports the plain receives of one endpoint at a time: the next endpoint bound to it
/// after the first closed counts its own (its queue running dry is seen, once).
#[test]
fn a_cq_counts_plain_receives_afresh_for_the_next_endpoint() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let rx = MemoryRegion::alloc(&p.domain, 4096, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 4096, Flags::SEND).unwrap();
    let mtu = p.b.max_msg_size();
    for i in 0..3 {
        p.b.recv(&rx, 0, mtu, i).unwrap();
        p.a.send(&tx, 0, 8, p.to_b, 0).unwrap();
        assert_eq!(wait_one(&p.b_cq).op_context, i);
    }
    let Pair {
        domain,
        av,
        a,
        b,
        b_cq,
        ..
    } = p;
    drop(b);
    let c = DgramEndpoint::open(&domain, &info).unwrap();
    c.bind_cq(&b_cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    c.bind_av(&av).unwrap();
    c.enable().unwrap();
    let to_c = av.insert(&c.getname().unwrap().to_bytes()).unwrap();
    assert_eq!(c.rx_dry_events(), 0);
    c.recv(&rx, 0, mtu, 7).unwrap();
    a.send(&tx, 0, 8, to_c, 0).unwrap();
    let e = wait_one(&b_cq);
    assert_eq!((e.op_context, e.len), (7, 8));
    assert_eq!(
        c.rx_dry_events(),
        1,
        "its one receive is used: its queue is dry"
    );
}

/// Plain receives (the CQ reports them) and ones the endpoint places itself (a short one
/// with its overflow sink) complete in posting order, each with its own length; the queue
/// running dry across both kinds counts once.
#[test]
fn plain_and_short_receives_complete_in_order_and_a_dry_queue_counts_once() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let p = pair(&info, AvType::Table);
    let rx = MemoryRegion::alloc(&p.domain, 16384, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 4096, Flags::SEND).unwrap();
    let mtu = p.b.max_msg_size();
    tx.write_at(0, &pattern(mtu, 9)).unwrap();
    let (mut posted, mut completed) = (0, 0);
    for round in 0..3u64 {
        // plain, short, plain: three datagrams of 50, 300 and 20 bytes.
        p.b.recv(&rx, 0, mtu, 100 * round + 1).unwrap();
        p.b.recv(&rx, 4096, 100, 100 * round + 2).unwrap();
        p.b.recv(&rx, 8192, mtu, 100 * round + 3).unwrap();
        posted += 3;
        for len in [50, 300, 20] {
            p.a.send(&tx, 0, len, p.to_b, 7).unwrap();
            assert_eq!(wait_one(&p.a_cq).op_context, 7);
        }
        let e = wait_one(&p.b_cq);
        assert_eq!((e.op_context, e.len), (100 * round + 1, 50));
        let e = wait_err(&p.b_cq);
        assert_eq!(
            (e.op_context, e.err, e.len, e.olen),
            (100 * round + 2, errno::ETRUNC, 100, 200)
        );
        let e = wait_one(&p.b_cq);
        assert_eq!((e.op_context, e.len), (100 * round + 3, 20));
        completed += 3;
        let mut got = [0u8; 20];
        rx.read_at(8192, &mut got).unwrap();
        assert_eq!(got[..], pattern(mtu, 9)[..20]);
        assert_eq!(
            p.b.rx_dry_events(),
            round + 1,
            "each round ends with nothing posted, once"
        );
    }
    assert_eq!(posted, completed);
}

#[test]
fn a_datagram_longer_than_its_receive_is_truncated_with_olen_without_a_prefix() {
    a_datagram_longer_than_its_receive_is_truncated_with_olen(false);
}

#[test]
fn a_datagram_longer_than_its_receive_is_truncated_with_olen_with_the_prefix() {
    a_datagram_longer_than_its_receive_is_truncated_with_olen(true);
}

#[test]
fn counters_count_datagrams_sent_and_received_without_cq_entries() {
    let Some(info) = dgram_info(false) else {
        return;
    };
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    let av = AddressVector::open(&domain, &AvAttr::default()).unwrap();
    let attr = CntrAttr {
        wait_obj: WaitObj::Unspec,
        ..Default::default()
    };
    let mk = |dir: Flags| {
        let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
        let cntr = Counter::open(&domain, &attr).unwrap();
        let ep = DgramEndpoint::open(&domain, &info).unwrap();
        ep.bind_cq(
            &cq,
            Flags::TRANSMIT | Flags::RECV | Flags::SELECTIVE_COMPLETION,
        )
        .unwrap();
        assert_eq!(
            ep.bind_cntr(&cntr, Flags::READ).unwrap_err().errno(),
            errno::EINVAL,
            "no RMA on datagrams"
        );
        ep.bind_cntr(&cntr, dir).unwrap();
        ep.bind_av(&av).unwrap();
        ep.enable().unwrap();
        (ep, cq, cntr)
    };
    let (a, a_cq, sent) = mk(Flags::SEND);
    let (b, b_cq, got) = mk(Flags::RECV);
    let to_b = av.insert(&b.getname().unwrap().to_bytes()).unwrap();
    let tx = MemoryRegion::alloc(&domain, 8 * 256, Flags::SEND).unwrap();
    let rx = MemoryRegion::alloc(&domain, 8 * 256, Flags::RECV).unwrap();
    for i in 0..8 {
        b.recv(&rx, 256 * i, 256, i as u64).unwrap();
    }
    for i in 0..8 {
        let data = pattern(200, i as u8);
        if i % 2 == 0 {
            tx.write_at(256 * i, &data).unwrap();
            a.send(&tx, 256 * i, 200, to_b, i as u64).unwrap();
        } else {
            a.inject(&data, to_b).unwrap();
        }
        // One at a time: a datagram that finds no receive is dropped, not queued.
        got.wait(i as u64 + 1, 10_000).unwrap();
    }
    sent.wait(8, 10_000).unwrap();
    assert_eq!(
        (sent.read(), got.read(), sent.readerr(), got.readerr()),
        (8, 8, 0, 0)
    );
    for i in 0..8 {
        let mut m = [0u8; 200];
        rx.read_at(256 * i, &mut m).unwrap();
        assert!(m[..] == pattern(200, i as u8)[..], "datagram {i}");
    }
    for cq in [&a_cq, &b_cq] {
        assert!(cq
            .read(&mut [rfabric::core::cq::CqEntry::default(); 1])
            .is_err_and(|e| e.is_again()));
    }
}

/// A connected QP's sends on a UD queue pair (no destination, or an RDMA write) are
/// `EINVAL` and reach no provider, which would follow an address handle that is not there:
/// three refused, none completed.
#[test]
fn a_datagram_queue_pair_refuses_sends_without_a_destination() {
    use rfabric_sys::verbs::{send_flags, Context, Cq, ProtectionDomain, QpCaps, UdQp, WcBatch};
    if device_info().is_none() {
        return;
    }
    let ctx = Context::devices().unwrap()[0];
    let pd = ProtectionDomain::new(ctx).unwrap();
    let cq = Cq::new(ctx, 16, 0, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let (qp, _) = UdQp::new(&pd, &cq, &cq, caps, 1, 0x1111_1111).unwrap();
    let h = qp.handle();
    let refused = [
        h.post_send_inline(1, b"no destination", send_flags::SIGNALED, None),
        h.post_send_inline(2, b"", send_flags::SIGNALED, Some(7)),
        h.post_write_inline(3, b"rdma", 0x1000, 1, send_flags::SIGNALED, None),
    ];
    assert_eq!(refused, [Err(libc::EINVAL); 3]);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let mut batch = WcBatch::<4>::new();
    assert_eq!(
        cq.poll_batch(&mut batch, 4).unwrap().len(),
        0,
        "a refused send completed"
    );
}
