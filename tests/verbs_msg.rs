//! Device tests: RC messaging through the provider objects on a real verbs device.
//! On the host without a device they skip; in the VM (`RFABRIC_REQUIRE_DEVICE=1`) they fail.

mod common;

use common::*;
use rfabric::core::cq::CqEntry;
use rfabric::core::eq::EqEvent;
use rfabric::verbs::*;
use rfabric::*;
use std::net::SocketAddr;

#[test]
fn getinfo_describes_the_device_from_its_attributes() {
    let Some(info) = device_info() else { return };
    let dev = devices()
        .unwrap()
        .into_iter()
        .find(|d| d.name == info.domain_attr.name)
        .unwrap();
    assert_eq!(info.ep_attr.ep_type, EpType::Msg);
    assert_eq!(info.fabric_attr.prov_name, "rverbs");
    assert_eq!(info.ep_attr.max_msg_size, dev.port.max_msg_sz as usize);
    assert_eq!(info.tx_attr.iov_limit, dev.attr.max_sge as usize);
    assert_eq!(info.tx_attr.inject_size, dev.attr.max_sge as usize * 16);
    assert!(info.tx_attr.size > 0 && info.tx_attr.size <= dev.attr.max_qp_wr as usize);
    assert!(info.domain_attr.mr_mode.contains(MrMode::LOCAL));
    assert_eq!(info.domain_attr.cq_data_size, 4);
    assert!(info.caps.contains(Flags::MSG | Flags::SEND | Flags::RECV));
    assert!(
        info.src_addr.is_some(),
        "the device's IPv4 address should be found in its GID table"
    );
}

#[test]
fn getinfo_without_a_type_lists_rdm_first_then_msg() {
    if device_info().is_none() {
        return;
    }
    let v = getinfo(None, None, Flags::empty(), None).unwrap();
    assert_eq!(v[0].ep_attr.ep_type, EpType::Rdm);
    assert!(v.iter().any(|i| i.ep_attr.ep_type == EpType::Msg));
    assert!(v.iter().all(|i| i.ep_attr.ep_type != EpType::Dgram));
}

#[test]
fn getinfo_filters_by_hints_and_answers_enodata() {
    let Some(info) = device_info() else { return };
    let mut h = Info::default();
    h.domain_attr.name = info.domain_attr.name.clone();
    h.ep_attr.ep_type = EpType::Msg;
    h.tx_attr.size = 16;
    let got = getinfo(None, None, Flags::empty(), Some(&h)).unwrap();
    assert!(got
        .iter()
        .all(|i| i.domain_attr.name == info.domain_attr.name && i.tx_attr.size == 16));

    let mut h = Info::default();
    h.domain_attr.name = "no_such_dev".into();
    assert_eq!(
        getinfo(None, None, Flags::empty(), Some(&h))
            .unwrap_err()
            .errno(),
        errno::ENODATA
    );
    // RDM hints get rverbs' own RDM endpoint, never an MSG info.
    let mut h = Info::default();
    h.ep_attr.ep_type = EpType::Rdm;
    for i in getinfo(None, None, Flags::empty(), Some(&h)).unwrap() {
        assert_eq!(i.ep_attr.ep_type, EpType::Rdm);
    }
    let mut h = Info::default();
    h.tx_attr.inject_size = 1 << 20;
    assert_eq!(
        getinfo(None, None, Flags::empty(), Some(&h))
            .unwrap_err()
            .errno(),
        errno::ENODATA
    );
}

#[test]
fn connect_accept_carries_cm_data_both_ways() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_with(&info, b"hello from the client", b"welcome", |_, _, _| {});
    assert_eq!(p.connreq_data, b"hello from the client");
    assert_eq!(p.accept_data, b"welcome");
    assert!(p.client.is_connected() && p.server.is_connected());
    assert_eq!(p.client.getpeer(), p.server.getname());
    assert_eq!(p.server.getpeer(), p.client.getname());
}

fn exchange(
    p: &Pair,
    mr_tx: &MemoryRegion,
    mr_rx: &MemoryRegion,
    from_client: bool,
    len: usize,
    seed: u8,
) {
    let (tx, rx, txcq, rxcq) = if from_client {
        (&p.client, &p.server, &p.client_cq, &p.server_cq)
    } else {
        (&p.server, &p.client, &p.server_cq, &p.client_cq)
    };
    let data = pattern(len, seed);
    mr_tx.write_at(0, &data).unwrap();
    mr_rx.fill(0, len + 1, 0xa5).unwrap();
    rx.recv(mr_rx, 0, len + 1, 0x1000 + len as u64).unwrap();
    tx.send(mr_tx, 0, len, 0x2000 + len as u64).unwrap();
    let s = wait_one(txcq);
    assert_eq!(s.op_context, 0x2000 + len as u64);
    assert_eq!(s.flags(), Flags::MSG | Flags::SEND);
    let r = wait_one(rxcq);
    assert_eq!(r.op_context, 0x1000 + len as u64);
    assert_eq!(r.flags(), Flags::MSG | Flags::RECV);
    assert_eq!(r.len, len, "received length");
    let mut got = vec![0u8; len + 1];
    mr_rx.read_at(0, &mut got).unwrap();
    assert!(got[..len] == data[..], "payload of {len} bytes differs");
    assert_eq!(got[len], 0xa5, "byte past the message was written");
}

/// Sizes: every size to 4160 (across the inline limit and several MTUs), then powers of
/// two with their neighbours, up to and including the port's max_msg_size (8 MiB on rxe).
fn sizes(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..=4160).collect();
    let mut p = 8192;
    while p < max {
        v.extend([p - 1, p, p + 1]);
        p <<= 1;
    }
    v.extend([max - 1, max]);
    v
}

#[test]
fn send_recv_every_size_both_directions_with_bytes_checked() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let max = info.ep_attr.max_msg_size;
    assert!(
        max <= 64 << 20,
        "max_msg_size {max}: this test moves every power of two up to it"
    );
    let a = MemoryRegion::alloc(&p.domain, max + 1, Flags::SEND | Flags::RECV).unwrap();
    let b = MemoryRegion::alloc(&p.domain, max + 1, Flags::SEND | Flags::RECV).unwrap();
    for (k, len) in sizes(max).into_iter().enumerate() {
        exchange(&p, &a, &b, true, len, k as u8);
        exchange(&p, &b, &a, false, len, k as u8 ^ 0x5a);
    }
}

#[test]
fn thousands_of_messages_in_a_row_arrive_in_order() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    const N: usize = 5000;
    const WINDOW: usize = 64;
    const MSG: usize = 64;
    let txm = MemoryRegion::alloc(&p.domain, WINDOW * MSG, Flags::SEND).unwrap();
    let rxm = MemoryRegion::alloc(&p.domain, WINDOW * MSG, Flags::RECV).unwrap();
    for slot in 0..WINDOW {
        p.server.recv(&rxm, slot * MSG, MSG, slot as u64).unwrap();
    }
    let (mut sent, mut done, mut received) = (0usize, 0usize, 0usize);
    let mut out = [rfabric::core::cq::CqEntry::default(); 16];
    let start = std::time::Instant::now();
    while received < N {
        while sent < N && sent - done < WINDOW {
            let slot = sent % WINDOW;
            let mut m = [0u8; MSG];
            m[..8].copy_from_slice(&(sent as u64).to_le_bytes());
            m[8..].fill(sent as u8);
            txm.write_at(slot * MSG, &m).unwrap();
            p.client.send(&txm, slot * MSG, MSG, sent as u64).unwrap();
            sent += 1;
        }
        if let Ok(n) = p.client_cq.read(&mut out) {
            for e in &out[..n] {
                assert_eq!(e.op_context, done as u64, "send completions in order");
                done += 1;
            }
        }
        if let Ok(n) = p.server_cq.read(&mut out) {
            for e in &out[..n] {
                let slot = e.op_context as usize;
                let mut m = [0u8; MSG];
                rxm.read_at(slot * MSG, &mut m).unwrap();
                assert_eq!(
                    u64::from_le_bytes(m[..8].try_into().unwrap()),
                    received as u64,
                    "message order"
                );
                assert!(
                    m[8..].iter().all(|&b| b == received as u8),
                    "payload of message {received}"
                );
                assert_eq!(slot, received % WINDOW);
                received += 1;
                p.server.recv(&rxm, slot * MSG, MSG, slot as u64).unwrap();
            }
        }
        assert!(start.elapsed().as_secs() < 60, "stalled at {received}/{N}");
    }
}

#[test]
fn receive_posted_before_connect_gets_the_first_message() {
    let Some(info) = device_info() else { return };
    let mut rx = None;
    let p = connect_pair_with(&info, b"", b"", |domain, server, _client| {
        let m = MemoryRegion::alloc(domain, 256, Flags::RECV).unwrap();
        server.recv(&m, 0, 256, 77).unwrap();
        rx = Some(m);
    });
    let rx = rx.unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 256, Flags::SEND).unwrap();
    tx.write_at(0, b"first!").unwrap();
    p.client.send(&tx, 0, 6, 1).unwrap();
    let r = wait_one(&p.server_cq);
    assert_eq!((r.op_context, r.len), (77, 6));
    let mut got = [0u8; 6];
    rx.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"first!");
    wait_one(&p.client_cq);
}

#[test]
fn remote_cq_data_arrives_as_immediate_data() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&m, 32, 32, 5).unwrap();
    p.client.senddata(&m, 0, 16, 0xdead_beef, 6).unwrap();
    let r = wait_one(&p.server_cq);
    assert_eq!(r.flags(), Flags::MSG | Flags::RECV | Flags::REMOTE_CQ_DATA);
    assert_eq!((r.data, r.len), (0xdead_beef, 16));
    assert_eq!(
        p.client.senddata(&m, 0, 1, 1 << 32, 7).unwrap_err().errno(),
        errno::EINVAL
    );
    wait_one(&p.client_cq);
}

#[test]
fn shutdown_is_seen_by_the_peer_and_cancels_its_posted_receives() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 64, Flags::RECV).unwrap();
    p.server.recv(&m, 0, 64, 42).unwrap();
    p.client.shutdown().unwrap();
    match next_event(&p.server_eq) {
        EqEvent::Shutdown { fid } => assert_eq!(fid, SERVER_FID),
        other => panic!("expected FI_SHUTDOWN, got {other:?}"),
    }
    assert!(!p.server.is_connected());
    let e = wait_err(&p.server_cq);
    assert_eq!((e.op_context, e.err), (42, errno::ECANCELED));
    assert_eq!(
        Flags::from_bits_retain(e.flags),
        Flags::MSG | Flags::RECV,
        "error entries name the operation"
    );
    assert_eq!(
        p.server_cq.strerror(e.prov_errno),
        "Work Request Flushed Error"
    );
    // The side that shut down gets its own FI_SHUTDOWN too, once (as libfabric's verbs
    // provider does: applications wait for it after fi_shutdown).
    match next_event(&p.client_eq) {
        EqEvent::Shutdown { fid } => assert_eq!(fid, CLIENT_FID),
        other => panic!("expected the local FI_SHUTDOWN, got {other:?}"),
    }
    p.server.shutdown().unwrap();
    assert_eq!(p.client_eq.sread(300).unwrap_err().errno(), errno::EAGAIN);
    assert_eq!(p.server_eq.sread(300).unwrap_err().errno(), errno::EAGAIN);
}

/// A server that accepts, shuts the connection down itself and waits on its EQ, as
/// applications written against libfabric's verbs provider do: FI_SHUTDOWN arrives on
/// both sides, once each.
#[test]
fn a_server_that_shuts_down_first_gets_its_own_fi_shutdown() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    p.server.shutdown().unwrap();
    // The client reads its EQ first, as its own process would: rdma_cm answers the
    // disconnect there, and that answer is what the server's own event waits for.
    match next_event(&p.client_eq) {
        EqEvent::Shutdown { fid } => assert_eq!(fid, CLIENT_FID),
        other => panic!("expected FI_SHUTDOWN at the client, got {other:?}"),
    }
    match next_event(&p.server_eq) {
        EqEvent::Shutdown { fid } => assert_eq!(fid, SERVER_FID),
        other => panic!("expected FI_SHUTDOWN at the server, got {other:?}"),
    }
    p.client.shutdown().unwrap();
    assert_eq!(p.server_eq.sread(300).unwrap_err().errno(), errno::EAGAIN);
    assert_eq!(p.client_eq.sread(300).unwrap_err().errno(), errno::EAGAIN);
}

#[test]
fn reject_delivers_its_data_in_an_econnrefused_error_entry() {
    let Some(info) = device_info() else { return };
    let (fabric, server_eq, pep, addr) = listener(&info);
    let domain = Domain::open(&fabric, &info).unwrap();
    let ceq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let cinfo = client_info(&addr);
    let client = MsgEndpoint::open(&domain, &cinfo, CLIENT_FID).unwrap();
    client.bind_eq(&ceq).unwrap();
    client.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    client.enable().unwrap();
    client.connect(b"let me in").unwrap();
    let EqEvent::ConnReq {
        info: req, data, ..
    } = next_event(&server_eq)
    else {
        panic!("expected FI_CONNREQ")
    };
    assert_eq!(data, b"let me in");
    let handle = req
        .handle
        .clone()
        .unwrap()
        .downcast::<ConnRequest>()
        .unwrap();
    pep.reject(&handle, b"not today").unwrap();
    assert_eq!(
        pep.reject(&handle, b"").unwrap_err().errno(),
        errno::EINVAL,
        "a request is answered once"
    );
    assert_eq!(ceq.sread(10_000).unwrap_err().errno(), errno::EAVAIL);
    let e = ceq.readerr().unwrap();
    assert_eq!(
        (e.fid, e.err, e.err_data.as_slice()),
        (CLIENT_FID, errno::ECONNREFUSED, &b"not today"[..])
    );
}

#[test]
fn bad_calls_return_errors_and_leave_the_endpoint_usable() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 128, Flags::SEND | Flags::RECV).unwrap();
    assert_eq!(
        p.client.send(&m, 100, 29, 0).unwrap_err().errno(),
        errno::EINVAL,
        "range past the region"
    );
    assert_eq!(
        p.client.recv(&m, usize::MAX, 2, 0).unwrap_err().errno(),
        errno::EINVAL,
        "offset overflow"
    );
    let too_big = info.ep_attr.max_msg_size + 1;
    assert_eq!(
        p.client.send(&m, 0, too_big, 0).unwrap_err().errno(),
        errno::EMSGSIZE
    );
    let other = Domain::open(&p.fabric, &info).unwrap();
    let foreign = MemoryRegion::alloc(&other, 64, Flags::SEND).unwrap();
    assert_eq!(
        p.client.send(&foreign, 0, 8, 0).unwrap_err().errno(),
        errno::EINVAL,
        "MR of another domain"
    );
    assert_eq!(
        MemoryRegion::alloc(&p.domain, 8, Flags::TAGGED)
            .unwrap_err()
            .errno(),
        errno::EINVAL
    );
    assert_eq!(p.client.connect(b"").unwrap_err().errno(), errno::EISCONN);
    assert_eq!(
        p.client
            .bind_cq(&p.client_cq, Flags::TRANSMIT)
            .unwrap_err()
            .errno(),
        errno::EOPBADSTATE
    );
    assert_eq!(
        p.client
            .bind_cq(&p.client_cq, Flags::READ)
            .unwrap_err()
            .errno(),
        errno::EBADFLAGS
    );
    assert_eq!(
        p.client.connect(&[0; 56]).unwrap_err().errno(),
        errno::EINVAL,
        "CM data over FI_OPT_CM_DATA_SIZE"
    );
    // Still usable.
    exchange(
        &p,
        &m,
        &MemoryRegion::alloc(&p.domain, 128, Flags::RECV).unwrap(),
        true,
        100,
        3,
    );
}

#[test]
fn endpoints_refuse_to_connect_or_enable_without_their_queues() {
    let Some(info) = device_info() else { return };
    let (fabric, _eq, _pep, addr) = listener(&info);
    let domain = Domain::open(&fabric, &info).unwrap();
    let cinfo = client_info(&addr);
    let ep = MsgEndpoint::open(&domain, &cinfo, 1).unwrap();
    let m = MemoryRegion::alloc(&domain, 8, Flags::SEND).unwrap();
    assert_eq!(
        ep.send(&m, 0, 8, 0).unwrap_err().errno(),
        errno::EOPBADSTATE,
        "send before enable"
    );
    assert_eq!(ep.enable().unwrap_err().errno(), errno::ENOCQ);
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    ep.enable().unwrap();
    assert_eq!(ep.connect(b"").unwrap_err().errno(), errno::ENOEQ);
    let mut no_dest = cinfo.clone();
    no_dest.dest_addr = None;
    assert_eq!(
        MsgEndpoint::open(&domain, &no_dest, 2).unwrap_err().errno(),
        errno::EINVAL
    );
}

#[test]
fn objects_close_in_any_order_a_rust_user_can_express() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let Pair {
        fabric,
        domain,
        server_eq,
        client_eq,
        server_cq,
        client_cq,
        pep,
        server,
        client,
        ..
    } = p;
    let m = MemoryRegion::alloc(&domain, 64, Flags::SEND | Flags::RECV).unwrap();
    // Drop the parents first: the endpoints keep what they need alive.
    drop(fabric);
    drop(domain);
    drop(pep);
    drop(server_eq);
    server.recv(&m, 32, 32, 1).unwrap();
    client.send(&m, 0, 8, 2).unwrap();
    assert_eq!(wait_one(&server_cq).len, 8);
    wait_one(&client_cq);
    drop(client_cq);
    drop(server);
    drop(m);
    drop(client);
    drop(client_eq);
    drop(server_cq);
}

#[test]
fn cq_grows_to_cover_every_bound_queue_pair() {
    let Some(info) = device_info() else { return };
    let (fabric, _eq, _pep, addr) = listener(&info);
    let domain = Domain::open(&fabric, &info).unwrap();
    let cq = CompletionQueue::open(
        &domain,
        &CqAttr {
            size: 16,
            ..Default::default()
        },
    )
    .unwrap();
    let cinfo = client_info(&addr);
    let mut eps = Vec::new();
    for i in 0..3 {
        let ep = MsgEndpoint::open(&domain, &cinfo, i).unwrap();
        ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
        ep.enable().unwrap();
        eps.push(ep);
    }
    // Each endpoint keeps tx_size + rx_size entries; three of them need more than 16.
    assert!(cinfo.tx_attr.size + cinfo.rx_attr.size > 16);
    assert!(
        cq.capacity() >= 3 * (cinfo.tx_attr.size + cinfo.rx_attr.size),
        "capacity {}",
        cq.capacity()
    );
    assert_eq!(
        cq.read::<rfabric::core::cq::CqEntry>(&mut []).unwrap(),
        0,
        "a zero-count read only drives progress"
    );
}

fn selective_pair(info: &Info) -> Pair {
    let opts = PairOpts {
        bind: Flags::SELECTIVE_COMPLETION,
        tx_size: 16,
        ..Default::default()
    };
    connect_pair_full(info, &opts, b"", b"", |_, _, _| {})
}

/// Drains `cq`, returning the contexts of the completions that arrive within `ms`.
fn drain_contexts(cq: &CompletionQueue, ms: u64) -> Vec<u64> {
    let mut got = Vec::new();
    let mut out = [rfabric::core::cq::CqEntry::default(); 16];
    let end = std::time::Instant::now() + std::time::Duration::from_millis(ms);
    while std::time::Instant::now() < end {
        match cq.read(&mut out) {
            Ok(n) => got.extend(out[..n].iter().map(|e| e.op_context)),
            Err(e) if e.is_again() => {}
            Err(e) => panic!("{e} {:?}", cq.readerr()),
        }
    }
    got
}

#[test]
fn selective_completion_reports_only_the_sends_that_ask_and_never_overflows_the_queue() {
    let Some(info) = device_info() else { return };
    let p = selective_pair(&info);
    let tx = MemoryRegion::alloc(&p.domain, 64, Flags::SEND).unwrap();
    let rx = MemoryRegion::alloc(&p.domain, 64 * 8, Flags::RECV).unwrap();
    const N: u64 = 400;
    let mut received = 0u64;
    let mut asked = Vec::new();
    let mut out = [rfabric::core::cq::CqEntry::default(); 16];
    for slot in 0..8 {
        p.server
            .recvmsg(&rx, slot * 64, 64, slot as u64, Flags::COMPLETION)
            .unwrap();
    }
    let mut i = 0;
    while i < N || received < N {
        if i < N {
            tx.write_at(0, &i.to_le_bytes()).unwrap();
            let r = if i % 50 == 0 {
                p.client.sendmsg(&tx, 0, 8, 1000 + i, 0, Flags::COMPLETION)
            } else {
                p.client.send(&tx, 0, 8, 1000 + i)
            };
            match r {
                Ok(()) => {
                    if i % 50 == 0 {
                        asked.push(1000 + i);
                    }
                    i += 1;
                }
                Err(e) if e.is_again() => {} // the 16-deep queue is full: reading the CQ frees it
                Err(e) => panic!("{e}"),
            }
        }
        if let Ok(n) = p.client_cq.read(&mut out) {
            for e in &out[..n] {
                assert!(
                    asked.contains(&e.op_context),
                    "completion {} was not asked for",
                    e.op_context
                );
            }
        }
        if let Ok(n) = p.server_cq.read(&mut out) {
            for e in &out[..n] {
                let slot = e.op_context as usize;
                let mut b = [0u8; 8];
                rx.read_at(slot * 64, &mut b).unwrap();
                assert_eq!(u64::from_le_bytes(b), received, "message order");
                received += 1;
                p.server
                    .recvmsg(&rx, slot * 64, 64, slot as u64, Flags::COMPLETION)
                    .unwrap();
            }
        }
    }
    let rest = drain_contexts(&p.client_cq, 300);
    assert!(rest.iter().all(|c| asked.contains(c)), "{rest:?}");
}

#[test]
fn receives_under_selective_completion_report_only_when_asked() {
    let Some(info) = device_info() else { return };
    let p = selective_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 256, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&m, 128, 64, 1).unwrap();
    p.server.recvmsg(&m, 192, 64, 2, Flags::COMPLETION).unwrap();
    p.client.inject(b"first").unwrap();
    p.client.inject(b"second").unwrap();
    assert_eq!(
        drain_contexts(&p.server_cq, 500),
        vec![2],
        "only the receive that asked completes"
    );
    let mut got = [0u8; 6];
    m.read_at(192, &mut got).unwrap();
    assert_eq!(&got, b"second");
    m.read_at(128, &mut got[..5]).unwrap();
    assert_eq!(
        &got[..5],
        b"first",
        "the silent receive still got its message"
    );
}

#[test]
fn inject_sends_with_no_completion_and_the_buffer_free_on_return() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let rx = MemoryRegion::alloc(&p.domain, 64 * 40, Flags::RECV).unwrap();
    for k in 0..40 {
        p.server.recv(&rx, k * 64, 64, k as u64).unwrap();
    }
    for k in 0u8..39 {
        let mut buf = [k; 32];
        p.client.inject(&buf).unwrap();
        buf.fill(0xff); // free on return: this must not reach the peer
    }
    p.client.injectdata(b"with data", 0x1234).unwrap();
    let mut out = [rfabric::core::cq::CqEntry::default(); 1];
    for k in 0..40u64 {
        let e = wait_one(&p.server_cq);
        assert_eq!(e.op_context, k);
        let mut got = [0u8; 32];
        rx.read_at(k as usize * 64, &mut got).unwrap();
        if k < 39 {
            assert_eq!((e.len, got), (32, [k as u8; 32]));
        } else {
            assert_eq!((e.len, e.data, &got[..9]), (9, 0x1234, &b"with data"[..]));
        }
    }
    assert_eq!(
        p.client_cq.read(&mut out).unwrap_err().errno(),
        errno::EAGAIN,
        "injects complete silently"
    );
    let too_big = vec![0u8; p.client.inject_size() + 1];
    assert_eq!(
        p.client.inject(&too_big).unwrap_err().errno(),
        errno::EINVAL
    );
}

#[test]
fn sendmsg_flags_are_checked_per_the_man_page() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 8192, Flags::SEND | Flags::RECV).unwrap();
    let e = |f: Flags| p.client.sendmsg(&m, 0, 8, 1, 0, f).unwrap_err().errno();
    assert_eq!(e(Flags::MULTICAST), errno::EINVAL);
    assert_eq!(e(Flags::CLAIM), errno::EINVAL);
    assert_eq!(e(Flags::TAGGED), errno::EBADFLAGS);
    let big = p.client.inject_size() + 1;
    assert_eq!(
        p.client
            .sendmsg(&m, 0, big, 1, 0, Flags::INJECT)
            .unwrap_err()
            .errno(),
        errno::EINVAL
    );
    assert_eq!(
        p.server
            .recvmsg(&m, 0, 8, 1, Flags::DISCARD)
            .unwrap_err()
            .errno(),
        errno::EINVAL
    );
    assert_eq!(
        p.client.send(&m, 0, 8, 1 << 63).unwrap_err().errno(),
        errno::EINVAL,
        "reserved context bit"
    );
    assert_eq!(
        p.client.send(&m, 0, 8, 1 << 56).unwrap_err().errno(),
        errno::EINVAL,
        "reserved context byte"
    );
    // Every accepted flag works, and the completion levels are all met by the RC acknowledgement.
    p.server.recv(&m, 4096, 4096, 7).unwrap();
    let ok = Flags::COMPLETION
        | Flags::INJECT
        | Flags::REMOTE_CQ_DATA
        | Flags::FENCE
        | Flags::MORE
        | Flags::DELIVERY_COMPLETE;
    p.client.sendmsg(&m, 0, 16, 2, 99, ok).unwrap();
    let r = wait_one(&p.server_cq);
    assert_eq!((r.op_context, r.data, r.len), (7, 99, 16));
    assert_eq!(wait_one(&p.client_cq).op_context, 2);
}

#[test]
fn a_failed_unsignalled_send_still_reports_an_error_with_its_context() {
    let Some(info) = device_info() else { return };
    let p = selective_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 256, Flags::SEND | Flags::RECV).unwrap();
    p.server.recvmsg(&m, 128, 8, 1, Flags::COMPLETION).unwrap();
    p.client.send(&m, 0, 100, 0x77).unwrap(); // no FI_COMPLETION asked, and too big for the receive
    let e = wait_err(&p.client_cq);
    assert_eq!(e.op_context, 0x77);
    assert_ne!(e.err, 0);
    assert_eq!(Flags::from_bits_retain(e.flags), Flags::MSG | Flags::SEND);
}

#[test]
fn sendv_gathers_and_recvv_scatters_with_bytes_checked() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let a = MemoryRegion::alloc(&p.domain, 8192, Flags::SEND | Flags::RECV).unwrap();
    let b = MemoryRegion::alloc(&p.domain, 8192, Flags::SEND | Flags::RECV).unwrap();
    let r = MemoryRegion::alloc(&p.domain, 16384, Flags::RECV).unwrap();
    let (x, y, z) = (pattern(1000, 1), pattern(3000, 2), pattern(50, 3));
    a.write_at(100, &x).unwrap();
    b.write_at(0, &y).unwrap();
    a.write_at(5000, &z).unwrap();
    // Two receive ranges, the first smaller than the message: the rest spills into the second.
    r.fill(0, 16384, 0).unwrap();
    p.server
        .recvv(&[(&r, 0, 2000), (&r, 8000, 4000)], 11)
        .unwrap();
    p.client
        .sendv(&[(&a, 100, 1000), (&b, 0, 3000), (&a, 5000, 50)], 12)
        .unwrap();
    assert_eq!(wait_one(&p.client_cq).op_context, 12);
    let e = wait_one(&p.server_cq);
    assert_eq!((e.op_context, e.len), (11, 4050));
    let mut whole = [x.clone(), y.clone(), z.clone()].concat();
    let mut got = vec![0u8; 2000];
    r.read_at(0, &mut got).unwrap();
    assert!(got[..] == whole[..2000]);
    let mut rest = vec![0u8; 2050];
    r.read_at(8000, &mut rest).unwrap();
    assert!(rest[..] == whole[2000..]);
    // A small gather goes inline and still arrives whole.
    p.server.recvv(&[(&r, 0, 64)], 13).unwrap();
    p.client.sendv(&[(&a, 100, 10), (&b, 0, 10)], 14).unwrap();
    assert_eq!(wait_one(&p.server_cq).len, 20);
    wait_one(&p.client_cq);
    let mut small = vec![0u8; 20];
    r.read_at(0, &mut small).unwrap();
    whole = [x[..10].to_vec(), y[..10].to_vec()].concat();
    assert_eq!(small, whole);
    // No range at all: a message of no bytes, received by a receive of none.
    p.server.recvv(&[], 15).unwrap();
    p.client.sendv(&[], 16).unwrap();
    assert_eq!(wait_one(&p.client_cq).op_context, 16);
    let e = wait_one(&p.server_cq);
    assert_eq!((e.op_context, e.len), (15, 0));
    // Bad iovs: too many ranges, a range outside its region.
    let many: Vec<Iov<'_>> = (0..33).map(|_| (&a, 0usize, 1usize)).collect();
    assert_eq!(p.client.sendv(&many, 1).unwrap_err().errno(), errno::EINVAL);
    assert_eq!(
        p.client.sendv(&[(&a, 8000, 500)], 1).unwrap_err().errno(),
        errno::EINVAL
    );
}

/// Child half of `a_killed_peer_process_is_seen_as_fi_shutdown`: connects to the address in
/// RFABRIC_TEST_CONNECT, says so on stdout, and waits to be killed. Run only by that test.
#[test]
#[ignore = "the child process of a_killed_peer_process_is_seen_as_fi_shutdown"]
fn child_connects_and_waits_to_be_killed() {
    let target = std::env::var("RFABRIC_TEST_CONNECT")
        .expect("run by a_killed_peer_process_is_seen_as_fi_shutdown");
    let addr: std::net::SocketAddr = target.parse().unwrap();
    let info = client_info(&addr);
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let ep = MsgEndpoint::open(&domain, &info, 1).unwrap();
    ep.bind_eq(&eq).unwrap();
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    ep.enable().unwrap();
    ep.connect(b"").unwrap();
    assert!(matches!(next_event(&eq), EqEvent::Connected { .. }));
    println!("CHILD CONNECTED");
    std::thread::sleep(std::time::Duration::from_secs(120));
}

#[test]
fn a_killed_peer_process_is_seen_as_fi_shutdown() {
    use std::io::BufRead;
    let Some(info) = device_info() else { return };
    let (fabric, eq, _pep, addr) = listener(&info);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_connects_and_waits_to_be_killed",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("RFABRIC_TEST_CONNECT", addr.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let EqEvent::ConnReq { info: req, .. } = next_event(&eq) else {
        panic!("expected FI_CONNREQ")
    };
    let domain = Domain::open(&fabric, &req).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let ep = MsgEndpoint::open(&domain, &req, SERVER_FID).unwrap();
    ep.bind_eq(&eq).unwrap();
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    ep.enable().unwrap();
    let m = MemoryRegion::alloc(&domain, 64, Flags::RECV).unwrap();
    ep.recv(&m, 0, 64, 0x99).unwrap();
    ep.accept(b"").unwrap();
    assert!(matches!(
        next_event(&eq),
        EqEvent::Connected {
            fid: SERVER_FID,
            ..
        }
    ));
    // libtest prints its own lines first: read until the child's marker.
    let lines = std::io::BufReader::new(child.stdout.as_mut().unwrap()).lines();
    let seen: Vec<String> = lines
        .map_while(Result::ok)
        .take_while(|l| !l.contains("CHILD CONNECTED"))
        .collect();
    assert!(seen.len() < 20, "the child never connected: {seen:?}");
    child.kill().unwrap();
    child.wait().unwrap();
    match next_event(&eq) {
        EqEvent::Shutdown { fid } => assert_eq!(fid, SERVER_FID),
        other => panic!("expected FI_SHUTDOWN after the peer died, got {other:?}"),
    }
    let e = wait_err(&cq);
    assert_eq!(
        (e.op_context, e.err),
        (0x99, errno::ECANCELED),
        "the posted receive is canceled"
    );
}

#[test]
fn endpoint_options_follow_fi_endpoint_3() {
    let Some(info) = device_info() else { return };
    // The full FI_OPT_CM_DATA_SIZE travels both ways.
    let max = vec![0x5au8; 55];
    let p = connect_pair_with(&info, &max, &max, |_, _, _| {});
    assert_eq!((p.connreq_data.len(), p.accept_data.len()), (55, 55));
    assert_eq!(p.client.getopt(EpOpt::CmDataSize).unwrap(), 55);
    assert_eq!(p.pep.cm_data_size(), 55);
    assert_eq!(
        p.client.setopt(EpOpt::CmDataSize, 10).unwrap_err().errno(),
        errno::ENOPROTOOPT,
        "read-only"
    );
    assert_eq!(
        p.client.getopt(EpOpt::BufferedMin).unwrap_err().errno(),
        errno::ENOPROTOOPT
    );
    assert_eq!(
        p.client.setopt(EpOpt::TxSize, 8).unwrap_err().errno(),
        errno::EOPBADSTATE,
        "fixed once enabled"
    );
    // Queue sizes set before enable are what the queue pair gets.
    let (fabric, _eq, _pep, addr) = listener(&info);
    let domain = Domain::open(&fabric, &info).unwrap();
    let ep = MsgEndpoint::open(&domain, &client_info(&addr), 1).unwrap();
    assert_eq!(
        ep.setopt(EpOpt::RxSize, 0).unwrap_err().errno(),
        errno::EINVAL
    );
    ep.setopt(EpOpt::TxSize, 24).unwrap();
    ep.setopt(EpOpt::RxSize, 40).unwrap();
    assert_eq!(
        (
            ep.getopt(EpOpt::TxSize).unwrap(),
            ep.getopt(EpOpt::RxSize).unwrap()
        ),
        (24, 40)
    );
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    ep.enable().unwrap();
    let caps = ep.qp_caps().unwrap();
    assert!(caps.max_send_wr >= 24 && caps.max_recv_wr >= 40, "{caps:?}");
    assert_eq!(ep.getopt(EpOpt::TxSize).unwrap(), caps.max_send_wr as usize);
}

#[test]
fn the_listen_backlog_is_set_before_listening() {
    let Some(info) = device_info() else { return };
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let mut pinfo = info.clone();
    pinfo.src_addr.as_mut().unwrap().set_port(0);
    let pep = PassiveEndpoint::open(&fabric, &pinfo, PEP_FID).unwrap();
    pep.bind_eq(&eq).unwrap();
    assert_eq!(pep.set_backlog(0).unwrap_err().errno(), errno::EINVAL);
    pep.set_backlog(4).unwrap();
    assert_eq!(pep.backlog(), 4);
    pep.listen().unwrap();
    assert_eq!(pep.set_backlog(8).unwrap_err().errno(), errno::EOPBADSTATE);
    assert_eq!(
        pep.listen().unwrap_err().errno(),
        errno::EOPBADSTATE,
        "listening twice"
    );
    // It still takes a connection.
    let addr = pep.getname().unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    let ceq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let c = MsgEndpoint::open(&domain, &client_info(&addr), CLIENT_FID).unwrap();
    c.bind_eq(&ceq).unwrap();
    c.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    c.enable().unwrap();
    c.connect(b"hi").unwrap();
    assert!(matches!(next_event(&eq), EqEvent::ConnReq { .. }));
}

#[test]
fn shutdown_writes_canceled_operations_before_it_returns() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 256, Flags::RECV).unwrap();
    for k in 0..3u64 {
        p.client.recv(&m, k as usize * 64, 64, 100 + k).unwrap();
    }
    p.client.shutdown().unwrap();
    // No polling loop: fi_cm(3) says the cancellations are written when shutdown returns.
    let mut out = [rfabric::core::cq::CqEntry::default(); 4];
    for k in 0..3u64 {
        assert_eq!(
            p.client_cq.read(&mut out).unwrap_err().errno(),
            errno::EAVAIL,
            "cancellation {k} is there"
        );
        let e = p.client_cq.readerr().unwrap();
        assert_eq!((e.op_context, e.err), (100 + k, errno::ECANCELED));
        assert_eq!(Flags::from_bits_retain(e.flags), Flags::MSG | Flags::RECV);
    }
    assert_eq!(
        p.client_cq.read(&mut out).unwrap_err().errno(),
        errno::EAGAIN,
        "shutdown's markers are never reported"
    );
    match next_event(&p.server_eq) {
        EqEvent::Shutdown { fid } => assert_eq!(fid, SERVER_FID),
        other => panic!("expected FI_SHUTDOWN, got {other:?}"),
    }
}

#[test]
fn fi_more_chains_sends_and_receives_until_the_batch_ends() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let tx = MemoryRegion::alloc(&p.domain, 64 * 1024, Flags::SEND).unwrap();
    let rx = MemoryRegion::alloc(&p.domain, 64 * 1024, Flags::RECV).unwrap();
    let msg = |i: usize| pattern(1000 + i, i as u8);
    for i in 0..4 {
        p.server
            .recvmsg(&rx, i * 1024, 1024, 100 + i as u64, Flags::MORE)
            .unwrap();
    }
    for i in 0..3 {
        tx.write_at(i * 1024, &msg(i)).unwrap();
        p.client
            .sendmsg(&tx, i * 1024, msg(i).len(), 200 + i as u64, 0, Flags::MORE)
            .unwrap();
    }
    // Chained sends have not reached the device: nothing completes anywhere.
    assert_eq!(drain_contexts(&p.client_cq, 300), Vec::<u64>::new());
    tx.write_at(3 * 1024, &msg(3)).unwrap();
    p.client
        .sendmsg(&tx, 3 * 1024, msg(3).len(), 203, 0, Flags::empty())
        .unwrap();
    // The sends are on the wire, but the receives are still chained: the receiver is not
    // ready, so the sends wait (RNR retries) and neither side completes anything.
    assert_eq!(drain_contexts(&p.server_cq, 300), Vec::<u64>::new());
    assert_eq!(drain_contexts(&p.client_cq, 10), Vec::<u64>::new());
    p.server.recv(&rx, 4 * 1024, 1024, 104).unwrap();
    for i in 0..4 {
        let e = wait_one(&p.server_cq);
        assert_eq!((e.op_context, e.len), (100 + i as u64, msg(i).len()));
        let mut got = vec![0u8; msg(i).len()];
        rx.read_at(i * 1024, &mut got).unwrap();
        assert!(got == msg(i), "message {i} bytes");
        assert_eq!(wait_one(&p.client_cq).op_context, 200 + i as u64);
    }
    // A batch longer than the chain goes out in parts, in order; an inject ends a batch
    // after the chained sends before it.
    let n = 40;
    for i in 0..n {
        p.server
            .recv(&rx, 8192 + i * 64, 64, 300 + i as u64)
            .unwrap();
    }
    for i in 0..n - 1 {
        tx.write_at(i * 8, &(i as u64).to_le_bytes()).unwrap();
        p.client
            .sendmsg(&tx, i * 8, 8, 400 + i as u64, 0, Flags::MORE)
            .unwrap();
    }
    p.client.inject(&((n - 1) as u64).to_le_bytes()).unwrap();
    // The first receive (104) takes the first message.
    let first = wait_one(&p.server_cq);
    assert_eq!((first.op_context, first.len), (104, 8));
    for i in 1..n {
        let e = wait_one(&p.server_cq);
        assert_eq!((e.op_context, e.len), (300 + i as u64 - 1, 8));
        let mut v = [0u8; 8];
        rx.read_at(8192 + (i - 1) * 64, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), i as u64, "message {i} in order");
    }
    let sent: Vec<u64> = (0..n - 1).map(|i| 400 + i as u64).collect();
    let mut got = Vec::new();
    while got.len() < sent.len() {
        got.push(wait_one(&p.client_cq).op_context);
    }
    assert_eq!(got, sent);
}

#[test]
fn names_follow_the_addrlen_rules_and_setname_picks_the_address() {
    use rfabric::core::addr::{parse_sockaddr, SOCKADDR_IN_LEN};
    let Some(info) = device_info() else { return };
    let ip = info.src_addr.unwrap().ip();
    // A passive endpoint moved to a chosen address before listening.
    let (fabric, eq, mut pep, _) = {
        let fabric = Fabric::open(&info.fabric_attr).unwrap();
        let eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
        let mut pinfo = info.clone();
        pinfo.src_addr = Some(SocketAddr::new(ip, 0));
        let pep = PassiveEndpoint::open(&fabric, &pinfo, 1).unwrap();
        pep.bind_eq(&eq).unwrap();
        (fabric, eq, pep, ())
    };
    let first = pep.getname().unwrap().port();
    let want = SocketAddr::new(ip, if first == 40000 { 40001 } else { 40000 });
    pep.setname(&want).unwrap();
    assert_eq!(pep.getname(), Some(want));
    pep.listen().unwrap();
    assert_eq!(
        pep.setname(&SocketAddr::new(ip, 0)).unwrap_err().errno(),
        errno::EOPBADSTATE
    );
    // fi_getname's addrlen rules: too small is ETOOSMALL with the size needed.
    let mut buf = [0u8; 64];
    let mut len = 4;
    assert_eq!(
        pep.getname_into(&mut buf, &mut len).unwrap_err().errno(),
        errno::ETOOSMALL
    );
    assert_eq!(len, SOCKADDR_IN_LEN);
    pep.getname_into(&mut buf, &mut len).unwrap();
    assert_eq!(parse_sockaddr(&buf[..len]).unwrap(), want);
    drop((pep, eq, fabric));

    // A client that chose its own address is seen from there by the server.
    let opts = PairOpts {
        client_name: Some(SocketAddr::new(ip, 0)),
        ..Default::default()
    };
    let p = connect_pair_full(&info, &opts, b"", b"", |_, _, _| {});
    let (mut a, mut b) = ([0u8; 64], [0u8; 64]);
    let (mut la, mut lb) = (a.len(), b.len());
    p.client.getname_into(&mut a, &mut la).unwrap();
    p.server.getpeer_into(&mut b, &mut lb).unwrap();
    assert_eq!((la, lb), (SOCKADDR_IN_LEN, SOCKADDR_IN_LEN));
    assert_eq!(
        parse_sockaddr(&a[..la]).unwrap(),
        p.server.getpeer().unwrap()
    );
    assert_eq!(&a[..la], &b[..lb]);
    let mut peer = [0u8; 64];
    let mut lp = 64;
    p.client.getpeer_into(&mut peer, &mut lp).unwrap();
    assert_eq!(
        parse_sockaddr(&peer[..lp]).unwrap(),
        p.server.getname().unwrap()
    );
    let mut small = 3;
    assert_eq!(
        p.server
            .getpeer_into(&mut b, &mut small)
            .unwrap_err()
            .errno(),
        errno::ETOOSMALL
    );
    assert_eq!(small, SOCKADDR_IN_LEN);
    // Too late, or not the endpoint's to choose.
    assert_eq!(
        p.client
            .setname(&SocketAddr::new(ip, 0))
            .unwrap_err()
            .errno(),
        errno::EOPBADSTATE
    );
    assert_eq!(
        p.server
            .setname(&SocketAddr::new(ip, 0))
            .unwrap_err()
            .errno(),
        errno::EOPBADSTATE
    );
    // getpeer before the connection is up is an error, not garbage.
    let cinfo = client_info(&p.server.getname().unwrap());
    let fresh = MsgEndpoint::open(&p.domain, &cinfo, 9).unwrap();
    let mut l = 64;
    assert_eq!(
        fresh.getpeer_into(&mut peer, &mut l).unwrap_err().errno(),
        errno::ENOTCONN
    );
}

#[test]
fn a_shared_receive_context_feeds_several_endpoints() {
    use rfabric::core::info::RxAttr;
    let Some(info) = device_info() else { return };
    let (fabric, server_eq, _pep, addr) = listener(&info);
    let domain = Domain::open(&fabric, &info).unwrap();
    let attr = RxAttr {
        size: 64,
        iov_limit: 2,
        ..Default::default()
    };
    let srx = SharedRxContext::open(&domain, &attr).unwrap();
    assert!(srx.size() >= 64);
    let server_cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let client_cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let rx = MemoryRegion::alloc(&domain, 64 * 1024, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&domain, 64 * 1024, Flags::SEND).unwrap();
    // Receives posted before any endpoint exists are there for all of them.
    for i in 0..4 {
        srx.recv(&rx, i * 4096, 4096, 100 + i as u64).unwrap();
    }
    srx.recvv(&[(&rx, 40000, 100), (&rx, 50000, 4000)], 104)
        .unwrap();
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    for c in 0..2u64 {
        let ceq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
        let client = MsgEndpoint::open(&domain, &client_info(&addr), 10 + c).unwrap();
        client.bind_eq(&ceq).unwrap();
        client
            .bind_cq(&client_cq, Flags::TRANSMIT | Flags::RECV)
            .unwrap();
        client.enable().unwrap();
        client.connect(b"").unwrap();
        let sinfo = match next_event(&server_eq) {
            EqEvent::ConnReq { info, .. } => *info,
            other => panic!("expected FI_CONNREQ, got {other:?}"),
        };
        let server = MsgEndpoint::open(&domain, &sinfo, 20 + c).unwrap();
        server.bind_eq(&server_eq).unwrap();
        server
            .bind_cq(&server_cq, Flags::TRANSMIT | Flags::RECV)
            .unwrap();
        server.bind_srx(&srx).unwrap();
        assert_eq!(
            server.bind_srx(&srx).unwrap_err().errno(),
            errno::EINVAL,
            "bound twice"
        );
        server.enable().unwrap();
        server.accept(b"").unwrap();
        assert!(matches!(next_event(&ceq), EqEvent::Connected { fid, .. } if fid == 10 + c));
        assert!(matches!(next_event(&server_eq), EqEvent::Connected { fid, .. } if fid == 20 + c));
        servers.push(server);
        clients.push((client, ceq));
    }
    // Messages from either connection take the shared receives in posting order.
    let msgs: Vec<Vec<u8>> = (0..4).map(|i| pattern(1000 * (i + 1), i as u8)).collect();
    for (i, m) in msgs.iter().enumerate() {
        let (client, _) = &clients[i % 2];
        tx.write_at(0, m).unwrap();
        client.send(&tx, 0, m.len(), 200 + i as u64).unwrap();
        assert_eq!(wait_one(&client_cq).op_context, 200 + i as u64);
        let e = wait_one(&server_cq);
        assert_eq!((e.op_context, e.len), (100 + i as u64, m.len()));
        let mut got = vec![0u8; m.len()];
        rx.read_at(i * 4096, &mut got).unwrap();
        assert!(&got == m, "message {i} bytes");
    }
    // The endpoints refuse receives of their own; the SRX refuses what it cannot do.
    assert_eq!(
        servers[0].recv(&rx, 0, 8, 1).unwrap_err().errno(),
        errno::EOPBADSTATE
    );
    assert_eq!(
        srx.recvmsg(&rx, 0, 8, 1, Flags::MULTI_RECV)
            .unwrap_err()
            .errno(),
        errno::EINVAL
    );
    assert_eq!(
        servers[0].bind_srx(&srx).unwrap_err().errno(),
        errno::EOPBADSTATE,
        "after enable"
    );
    // One endpoint shutting down leaves the shared receives to the other.
    servers[0].shutdown().unwrap();
    let m = pattern(3000, 9);
    tx.write_at(0, &m).unwrap();
    clients[1].0.send(&tx, 0, m.len(), 300).unwrap();
    assert_eq!(wait_one(&client_cq).op_context, 300);
    let e = wait_one(&server_cq);
    assert_eq!((e.op_context, e.len), (104, 3000));
    let (mut a, mut b) = (vec![0u8; 100], vec![0u8; 2900]);
    rx.read_at(40000, &mut a).unwrap();
    rx.read_at(50000, &mut b).unwrap();
    assert!([a, b].concat() == m, "scattered over the two ranges");
}

#[test]
fn multi_recv_packs_messages_into_one_buffer_and_releases_it() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    assert_eq!(p.server.getopt(EpOpt::MinMultiRecv).unwrap(), 64);
    p.server.setopt(EpOpt::MinMultiRecv, 1000).unwrap();
    assert_eq!(p.server.getopt(EpOpt::MinMultiRecv).unwrap(), 1000);
    let rx = MemoryRegion::alloc(&p.domain, 64 * 1024, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 64 * 1024, Flags::SEND).unwrap();
    rx.fill(0, 64 * 1024, 0xee).unwrap();
    // A 10000-byte buffer, and a plain receive posted behind it.
    p.server
        .recvmsg(&rx, 1000, 10000, 7, Flags::MULTI_RECV)
        .unwrap();
    p.server.recv(&rx, 40000, 4096, 8).unwrap();
    assert_eq!(
        p.server.recvv(&[(&rx, 0, 8)], 9).unwrap_err().errno(),
        errno::EOPBADSTATE,
        "a vectored receive cannot wait behind the buffer"
    );
    // Sent back to back: each waits (receiver not ready) until the rest is posted again.
    let sizes = [100usize, 3000, 1, 0, 2500, 2000, 1500, 700];
    let msgs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| pattern(*n, i as u8 + 1))
        .collect();
    let mut off = 0;
    for (i, m) in msgs.iter().enumerate() {
        tx.write_at(off, m).unwrap();
        p.client.send(&tx, off, m.len(), 100 + i as u64).unwrap();
        off += m.len().max(1);
    }
    // 10000 - (100 + 3000 + 1 + 0 + 2500 + 2000 + 1500) = 899 < 1000: released after the 7th.
    let mut at = 1000;
    for (i, m) in msgs.iter().enumerate().take(7) {
        let e = wait_one(&p.server_cq);
        let f = Flags::from_bits_retain(e.flags);
        assert_eq!((e.op_context, e.len), (7, m.len()), "message {i}");
        assert_eq!(
            e.buf,
            rx.addr() + at as u64,
            "message {i} packed after the previous"
        );
        assert_eq!(
            f.contains(Flags::MULTI_RECV),
            i == 6,
            "released with the 7th: {f:?}"
        );
        assert!(f.contains(Flags::RECV | Flags::MSG));
        let mut got = vec![0u8; m.len()];
        rx.read_at(at, &mut got).unwrap();
        assert!(&got == m, "message {i} bytes");
        at += m.len();
    }
    let mut tail = [0u8; 1];
    rx.read_at(at, &mut tail).unwrap();
    assert_eq!(tail[0], 0xee, "nothing written past the last message");
    let e = wait_one(&p.server_cq);
    assert_eq!(
        (e.op_context, e.len),
        (8, 700),
        "the receive behind the buffer"
    );
    assert_eq!(
        Flags::from_bits_retain(e.flags) & Flags::MULTI_RECV,
        Flags::empty()
    );
    let mut got = vec![0u8; 700];
    rx.read_at(40000, &mut got).unwrap();
    assert!(got == msgs[7]);
    for i in 0..msgs.len() {
        assert_eq!(wait_one(&p.client_cq).op_context, 100 + i as u64);
    }
    // Shutdown cancels a buffer still posted and the receive behind it, in order.
    p.server
        .recvmsg(&rx, 0, 8192, 20, Flags::MULTI_RECV)
        .unwrap();
    p.server.recv(&rx, 40000, 64, 21).unwrap();
    p.server.shutdown().unwrap();
    let a = wait_err(&p.server_cq);
    assert_eq!((a.op_context, a.err), (20, errno::ECANCELED));
    assert!(Flags::from_bits_retain(a.flags).contains(Flags::MULTI_RECV));
    let b = wait_err(&p.server_cq);
    assert_eq!((b.op_context, b.err), (21, errno::ECANCELED));
}

#[test]
fn a_message_longer_than_a_multi_recv_buffers_rest_is_truncated_not_fatal() {
    // Issue 15, finding 10: the rest of a buffer was posted whenever the minimum was left,
    // so a legal message longer than it broke the RC connection. It now spills into the
    // provider's overflow region and completes FI_ETRUNC; the connection lives on.
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let rx = MemoryRegion::alloc(&p.domain, 64 * 1024, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&p.domain, 64 * 1024, Flags::SEND).unwrap();
    rx.fill(0, 64 * 1024, 0xee).unwrap();
    p.server
        .recvmsg(&rx, 0, 1024, 7, Flags::MULTI_RECV)
        .unwrap();
    p.server.recv(&rx, 8192, 4096, 8).unwrap();
    let (a, b, c) = (pattern(600, 1), pattern(600, 2), pattern(3000, 3));
    tx.write_at(0, &a).unwrap();
    tx.write_at(1000, &b).unwrap();
    tx.write_at(2000, &c).unwrap();
    p.client.send(&tx, 0, 600, 100).unwrap();
    let e = wait_one(&p.server_cq);
    assert_eq!((e.op_context, e.len, e.buf), (7, 600, rx.addr()));
    // 424 bytes are left (more than the default minimum of 64): the next 600 do not fit.
    p.client.send(&tx, 1000, 600, 101).unwrap();
    let t = wait_err(&p.server_cq);
    assert_eq!(
        (t.op_context, t.err, t.len, t.olen, t.buf),
        (7, errno::ETRUNC, 424, 176, rx.addr() + 600)
    );
    assert!(Flags::from_bits_retain(t.flags).contains(Flags::MULTI_RECV | Flags::RECV));
    let mut got = vec![0u8; 424];
    rx.read_at(600, &mut got).unwrap();
    assert_eq!(&got[..], &b[..424]);
    let mut past = [0u8; 1];
    rx.read_at(1024, &mut past).unwrap();
    assert_eq!(past[0], 0xee, "nothing written past the buffer");
    // The connection is up: the next message reaches the receive behind the buffer.
    p.client.send(&tx, 2000, 3000, 102).unwrap();
    let e = wait_one(&p.server_cq);
    assert_eq!((e.op_context, e.len), (8, 3000));
    let mut got = vec![0u8; 3000];
    rx.read_at(8192, &mut got).unwrap();
    assert!(got == c);
    for i in 0..3 {
        assert_eq!(wait_one(&p.client_cq).op_context, 100 + i);
    }
    assert!(p.client.is_connected() && p.server.is_connected());
}

/// An application that passes the info's own rx attributes to `fi_srx_context` gets an
/// SRX: the info's receive limits are ones the device's SRQ takes too (rxe: 27 ranges,
/// where its QPs take 32).
#[test]
fn srx_opens_from_the_infos_own_rx_attr() {
    let Some(info) = device_info() else { return };
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    let dev = domain.device().attr.clone();
    assert!(info.rx_attr.iov_limit <= dev.max_srq_sge as usize);
    let srx = SharedRxContext::open(&domain, &info.rx_attr).unwrap();
    assert!(srx.size() >= info.rx_attr.size);
}

/// fi_getinfo(3) on the device, every combination of the eight mr_mode bits, and every
/// domain capability and ordering bit: each answer holds only mr_mode bits the hints
/// offered and every capability and ordering bit they asked for, or the answer is
/// `-FI_ENODATA`.
#[test]
fn getinfo_answers_honour_the_hints_bit_by_bit() {
    let Some(_) = device_info() else { return };
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
    let mut answered = 0;
    for combo in 1u32..256 {
        let offered = bits
            .iter()
            .enumerate()
            .filter(|(k, _)| combo & (1 << k) != 0)
            .fold(MrMode::empty(), |m, (_, b)| m | *b);
        let mut h = Info::default();
        h.ep_attr.ep_type = EpType::Msg;
        h.domain_attr.mr_mode = offered;
        match getinfo(None, None, Flags::empty(), Some(&h)) {
            Ok(v) => {
                answered += 1;
                for i in &v {
                    assert!(
                        offered.contains(i.domain_attr.mr_mode),
                        "{:?} answered for {offered:?}",
                        i.domain_attr.mr_mode
                    );
                }
            }
            Err(e) => {
                assert_eq!(e.errno(), errno::ENODATA, "{offered:?}");
                assert!(!offered.contains(MrMode::LOCAL), "{offered:?} refused: {e}");
            }
        }
    }
    assert_eq!(
        answered, 128,
        "every combination with FI_MR_LOCAL is answered"
    );
    for caps in [
        Flags::LOCAL_COMM,
        Flags::REMOTE_COMM,
        Flags::SHARED_AV,
        Flags::LOCAL_COMM | Flags::REMOTE_COMM | Flags::SHARED_AV,
    ] {
        let mut h = Info::default();
        h.domain_attr.caps = caps;
        match getinfo(None, None, Flags::empty(), Some(&h)) {
            Ok(v) => assert!(
                v.iter().all(|i| i.domain_attr.caps.contains(caps)),
                "{caps:?}"
            ),
            Err(e) => assert_eq!(e.errno(), errno::ENODATA, "{caps:?}"),
        }
    }
    for bit in 0..13 {
        for rx in [false, true] {
            let mut h = Info::default();
            if rx {
                h.rx_attr.msg_order = 1 << bit;
            } else {
                h.tx_attr.msg_order = 1 << bit;
            }
            match getinfo(None, None, Flags::empty(), Some(&h)) {
                Ok(v) => assert!(
                    v.iter().all(|i| {
                        let o = if rx {
                            i.rx_attr.msg_order
                        } else {
                            i.tx_attr.msg_order
                        };
                        o & (1 << bit) != 0
                    }),
                    "order bit {bit} rx {rx}"
                ),
                Err(e) => assert_eq!(e.errno(), errno::ENODATA, "order bit {bit} rx {rx}"),
            }
        }
    }
}

/// A multi-receive buffer posted with plain `fi_recv` on an endpoint whose default receive
/// flags hold `FI_MULTI_RECV` (as fabtests' multi_recv test posts it), read in every CQ
/// format that has `buf`: each completion says where its message landed, and the buffer
/// is released with the last message placed in it.
#[test]
fn multi_recv_from_default_flags_says_where_each_message_landed_in_every_format() {
    use rfabric::core::cq::CqDataEntry;
    let Some(info) = device_info() else { return };
    for format in [CqFormat::Data, CqFormat::Tagged] {
        let p = connect_pair_full(
            &info,
            &PairOpts {
                cq_attr: CqAttr {
                    format,
                    ..Default::default()
                },
                rx_op_flags: Flags::MULTI_RECV,
                ..Default::default()
            },
            b"",
            b"",
            |_, _, _| {},
        );
        p.server.setopt(EpOpt::MinMultiRecv, 600).unwrap();
        let rx = MemoryRegion::alloc(&p.domain, 4096, Flags::RECV).unwrap();
        let tx = MemoryRegion::alloc(&p.domain, 4096, Flags::SEND).unwrap();
        p.server.recv(&rx, 0, 2000, 77).unwrap();
        for i in 0..3u8 {
            tx.write_at(i as usize * 500, &pattern(500, i)).unwrap();
            p.client.send(&tx, i as usize * 500, 500, i as u64).unwrap();
        }
        // 2000 - 3 x 500 = 500 < 600: released with the third message.
        for i in 0..3u64 {
            let (buf, len, flags, ctx) = match format {
                CqFormat::Data => {
                    let e: CqDataEntry = wait_one_as(&p.server_cq);
                    (e.buf, e.len, e.flags, e.op_context)
                }
                _ => {
                    let e = wait_one(&p.server_cq);
                    (e.buf, e.len, e.flags, e.op_context)
                }
            };
            assert_eq!((ctx, len), (77, 500), "{format:?} message {i}");
            assert_eq!(
                buf,
                rx.addr() + i * 500,
                "{format:?}: where message {i} landed"
            );
            let mut got = vec![0u8; 500];
            rx.read_at(i as usize * 500, &mut got).unwrap();
            assert_eq!(got, pattern(500, i as u8));
            assert_eq!(
                Flags::from_bits_retain(flags).contains(Flags::MULTI_RECV),
                i == 2,
                "{format:?}: released with the last message only"
            );
        }
        for _ in 0..3 {
            match format {
                CqFormat::Data => drop(wait_one_as::<CqDataEntry>(&p.client_cq)),
                _ => drop(wait_one(&p.client_cq)),
            }
        }
    }
}

#[test]
fn setname_racing_bind_and_getname_keeps_one_identifier_that_connects() {
    // Issue 15, finding 7: fi_setname under FI_THREAD_SAFE dropped the rdma_cm id a
    // concurrent fi_ep_bind used. Now it is replaced under the endpoint's lock.
    let Some(info) = device_info() else { return };
    let (fabric, server_eq, _pep, addr) = listener(&info);
    let domain = Domain::open(&fabric, &info).unwrap();
    let client_eq = EventQueue::open(&fabric, &EqAttr::default()).unwrap();
    let cq = CompletionQueue::open(&domain, &CqAttr::default()).unwrap();
    let client = std::sync::Arc::new(MsgEndpoint::open(&domain, &client_info(&addr), 5).unwrap());
    let ip = addr.ip();
    std::thread::scope(|s| {
        let c = client.clone();
        let t = s.spawn(move || {
            for _ in 0..100 {
                c.setname(&SocketAddr::new(ip, 0)).unwrap();
            }
        });
        for i in 0..3000 {
            assert_eq!(client.getname().unwrap().ip(), ip);
            if i == 20 {
                client.bind_eq(&client_eq).unwrap();
            }
        }
        t.join().unwrap();
    });
    // The identifier the EQ knows is the last one: the connection comes up on it.
    client.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    client.enable().unwrap();
    let name = client.getname().unwrap();
    client.connect(b"").unwrap();
    let sinfo = match next_event(&server_eq) {
        EqEvent::ConnReq { info, .. } => *info,
        other => panic!("expected FI_CONNREQ, got {other:?}"),
    };
    let server = MsgEndpoint::open(&domain, &sinfo, 6).unwrap();
    server.bind_eq(&server_eq).unwrap();
    server.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    server.enable().unwrap();
    server.accept(b"").unwrap();
    assert!(matches!(
        next_event(&client_eq),
        EqEvent::Connected { fid: 5, .. }
    ));
    assert!(matches!(
        next_event(&server_eq),
        EqEvent::Connected { fid: 6, .. }
    ));
    assert_eq!(server.getpeer().unwrap(), name);
}

#[test]
fn queue_pairs_grant_remote_read_only_to_endpoints_with_rma() {
    // Issue 15, finding 11: rdma_cm granted remote read (responder resources 1) to
    // endpoints that asked for no RMA.
    let Some(info) = device_info() else { return };
    const IBV_ACCESS_REMOTE_READ: u32 = 4;
    let plain = PairOpts {
        caps: Some(Flags::MSG | Flags::SEND | Flags::RECV),
        ..Default::default()
    };
    let p = connect_pair_full(&info, &plain, b"", b"", |_, _, _| {});
    for ep in [&p.client, &p.server] {
        assert_eq!(ep.qp_access_flags().unwrap() & IBV_ACCESS_REMOTE_READ, 0);
    }
    assert!(info.caps.contains(Flags::RMA | Flags::REMOTE_READ));
    let p = connect_pair(&info);
    for ep in [&p.client, &p.server] {
        assert_ne!(ep.qp_access_flags().unwrap() & IBV_ACCESS_REMOTE_READ, 0);
    }
}

/// Sizes an RMA test moves: across the inline limit, the MTU and up to 1 MiB.
fn rma_sizes(inline: usize) -> Vec<usize> {
    vec![
        1,
        7,
        64,
        inline,
        inline + 1,
        1024,
        4096,
        4097,
        65536,
        1 << 20,
    ]
}

#[test]
fn rma_writes_and_reads_move_the_bytes_and_complete_as_fi_rma_says() {
    let Some(info) = device_info() else { return };
    assert!(info.domain_attr.mr_mode.contains(MrMode::VIRT_ADDR));
    rma_round_trips(&info);
}

/// An application whose mr_mode lacks `FI_MR_VIRT_ADDR` names remote memory by offset
/// into the region (fi_mr(3)); `FI_MR_ALLOCATED` it accepts is echoed.
#[test]
fn rma_by_offset_when_mr_mode_lacks_virt_addr() {
    let Some(_) = device_info() else { return };
    let mut h = Info::default();
    h.ep_attr.ep_type = EpType::Msg;
    h.caps = Flags::MSG | Flags::RMA;
    h.domain_attr.mr_mode = MrMode::LOCAL | MrMode::PROV_KEY | MrMode::ALLOCATED;
    let info = getinfo(None, None, Flags::empty(), Some(&h))
        .unwrap()
        .remove(0);
    assert_eq!(info.domain_attr.mr_mode, h.domain_attr.mr_mode);
    rma_round_trips(&info);
    // A virtual address is no offset: out of the region's range, refused by the target.
    let p = connect_pair(&info);
    let target = MemoryRegion::alloc(&p.domain, 4096, Flags::REMOTE_WRITE).unwrap();
    assert_eq!(target.remote_addr(), 0);
    let local = MemoryRegion::alloc(&p.domain, 4096, Flags::WRITE).unwrap();
    p.client
        .write(&local, 0, 8, target.addr(), target.key(), 1)
        .unwrap();
    let e = wait_err(&p.client_cq);
    assert_eq!((e.op_context, e.err), (1, errno::EACCES));
    // Registered twice, one region still: fi_close is not refused as busy.
    assert!(!target.in_use());
}

/// Writes and reads of every size at the target's `remote_addr` plus an offset.
fn rma_round_trips(info: &Info) {
    let p = connect_pair(info);
    let max = 1 << 20;
    let target = MemoryRegion::alloc(
        &p.domain,
        max + 64,
        Flags::REMOTE_WRITE | Flags::REMOTE_READ,
    )
    .unwrap();
    let local = MemoryRegion::alloc(&p.domain, max + 64, Flags::WRITE | Flags::READ).unwrap();
    let (addr, key) = (target.remote_addr(), target.key());
    let inline = p.client.inject_size();
    let mut posted = 0;
    let mut completed = 0;
    for (i, len) in rma_sizes(inline).into_iter().enumerate() {
        // Write at an offset, so the address is not the region's start.
        let data = pattern(len, i as u8);
        local.write_at(0, &data).unwrap();
        target.fill(0, max + 64, 0xa5).unwrap();
        p.client
            .write(&local, 0, len, addr + 16, key, 0x100 + i as u64)
            .unwrap();
        posted += 1;
        let c = wait_one(&p.client_cq);
        completed += 1;
        assert_eq!(c.op_context, 0x100 + i as u64);
        assert_eq!(c.flags(), Flags::RMA | Flags::WRITE);
        let mut got = vec![0u8; len + 32];
        target.read_at(0, &mut got).unwrap();
        assert!(
            got[..16].iter().all(|b| *b == 0xa5),
            "{len}: written before the address"
        );
        assert!(got[16..16 + len] == data[..], "{len}: written bytes differ");
        assert!(
            got[16 + len..].iter().all(|b| *b == 0xa5),
            "{len}: written past the range"
        );

        // Read back something else the target holds.
        let want = pattern(len, 100 + i as u8);
        target.write_at(8, &want).unwrap();
        local.fill(0, len + 1, 0x5a).unwrap();
        p.client
            .read(&local, 0, len, addr + 8, key, 0x200 + i as u64)
            .unwrap();
        posted += 1;
        let c = wait_one(&p.client_cq);
        completed += 1;
        assert_eq!(c.op_context, 0x200 + i as u64);
        assert_eq!(c.flags(), Flags::RMA | Flags::READ);
        let mut got = vec![0u8; len + 1];
        local.read_at(0, &mut got).unwrap();
        assert!(got[..len] == want[..], "{len}: read bytes differ");
        assert_eq!(got[len], 0x5a, "{len}: read past the range");
    }
    assert_eq!(posted, completed);
    // Nothing reached the target's CQ: plain writes and reads are one-sided.
    assert!(p
        .server_cq
        .read(&mut [CqEntry::default(); 1])
        .unwrap_err()
        .is_again());
}

#[test]
fn writedata_completes_a_receive_at_the_target_with_its_data() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let target = MemoryRegion::alloc(&p.domain, 1 << 16, Flags::REMOTE_WRITE).unwrap();
    let local = MemoryRegion::alloc(&p.domain, 1 << 16, Flags::WRITE).unwrap();
    let rx = MemoryRegion::alloc(&p.domain, 64, Flags::RECV).unwrap();
    for (i, len) in [0usize, 8, 5000].into_iter().enumerate() {
        let data = pattern(len, 40 + i as u8);
        local.write_at(0, &data).unwrap();
        p.server.recv(&rx, 0, 64, 0x300 + i as u64).unwrap();
        let cq_data = 0xbeef_0000 + i as u64;
        p.client
            .writedata(&local, 0, len, cq_data, target.addr(), target.key(), 0x400)
            .unwrap();
        let c = wait_one(&p.client_cq);
        assert_eq!(
            (c.op_context, c.flags()),
            (0x400, Flags::RMA | Flags::WRITE)
        );
        let r = wait_one(&p.server_cq);
        assert_eq!(r.op_context, 0x300 + i as u64, "the receive it consumed");
        assert_eq!(
            r.flags(),
            Flags::RMA | Flags::REMOTE_WRITE | Flags::REMOTE_CQ_DATA
        );
        assert_eq!((r.data, r.len), (cq_data, len));
        let mut got = vec![0u8; len];
        target.read_at(0, &mut got).unwrap();
        assert!(got == data, "{len}: bytes differ");
    }
    // inject_writedata: no completion at the initiator, one at the target.
    p.server.recv(&rx, 0, 64, 0x500).unwrap();
    p.client
        .inject_writedata(b"injected", 0x77, target.addr() + 100, target.key())
        .unwrap();
    let r = wait_one(&p.server_cq);
    assert_eq!((r.op_context, r.data, r.len), (0x500, 0x77, 8));
    let mut got = [0u8; 8];
    target.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"injected");
    assert!(p
        .client_cq
        .read(&mut [CqEntry::default(); 1])
        .unwrap_err()
        .is_again());
}

#[test]
fn inject_write_and_vectored_rma_complete_in_order_on_the_connection() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let target =
        MemoryRegion::alloc(&p.domain, 4096, Flags::REMOTE_WRITE | Flags::REMOTE_READ).unwrap();
    let a = MemoryRegion::alloc(&p.domain, 4096, Flags::WRITE | Flags::READ).unwrap();
    let b = MemoryRegion::alloc(&p.domain, 4096, Flags::WRITE | Flags::READ).unwrap();
    // inject_write: the buffer is free on return, nothing completes; a read behind it on
    // the same connection sees it (the responder executes in order).
    let mut buf = *b"first inject";
    p.client
        .inject_write(&buf, target.addr(), target.key())
        .unwrap();
    buf.fill(0);
    a.fill(0, 64, 0).unwrap();
    p.client
        .read(&a, 0, 12, target.addr(), target.key(), 1)
        .unwrap();
    let c = wait_one(&p.client_cq);
    assert_eq!((c.op_context, c.flags()), (1, Flags::RMA | Flags::READ));
    let mut got = [0u8; 12];
    a.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"first inject");

    // writemsg gathers two regions into one remote range; readmsg scatters it back.
    a.write_at(0, b"gathered ").unwrap();
    b.write_at(0, b"from two").unwrap();
    let rma = RmaIov {
        addr: target.addr() + 200,
        len: 17,
        key: target.key(),
    };
    p.client
        .writemsg(&[(&a, 0, 9), (&b, 0, 8)], &rma, 2, 0, Flags::COMPLETION)
        .unwrap();
    assert_eq!(wait_one(&p.client_cq).op_context, 2);
    let mut got = [0u8; 17];
    target.read_at(200, &mut got).unwrap();
    assert_eq!(&got, b"gathered from two");
    a.fill(0, 64, 0).unwrap();
    b.fill(0, 64, 0).unwrap();
    p.client
        .readmsg(&[(&b, 0, 9), (&a, 0, 8)], &rma, 3, Flags::COMPLETION)
        .unwrap();
    assert_eq!(wait_one(&p.client_cq).op_context, 3);
    let (mut x, mut y) = ([0u8; 9], [0u8; 8]);
    b.read_at(0, &mut x).unwrap();
    a.read_at(0, &mut y).unwrap();
    assert_eq!((&x, &y), (b"gathered ", b"from two"));
}

#[test]
fn bad_rma_calls_are_refused_and_post_nothing() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let target = MemoryRegion::alloc(&p.domain, 4096, Flags::REMOTE_WRITE).unwrap();
    let local = MemoryRegion::alloc(&p.domain, 4096, Flags::WRITE | Flags::READ).unwrap();
    let (addr, key) = (target.addr(), target.key());
    let e = |r: rfabric::core::error::Result<()>| r.unwrap_err().errno();
    assert_eq!(
        e(p.client.write(&local, 0, 8, addr, 1 << 40, 0)),
        errno::EINVAL
    );
    assert_eq!(
        e(p.client.write(&local, 4000, 200, addr, key, 0)),
        errno::EINVAL
    );
    let small = RmaIov { addr, len: 4, key };
    assert_eq!(
        e(p.client
            .writemsg(&[(&local, 0, 8)], &small, 0, 0, Flags::empty())),
        errno::EINVAL
    );
    let rma = RmaIov { addr, len: 8, key };
    assert_eq!(
        e(p.client.readmsg(&[(&local, 0, 8)], &rma, 0, Flags::INJECT)),
        errno::EINVAL
    );
    assert_eq!(
        e(p.client.readmsg(&[(&local, 0, 8)], &rma, 0, Flags::CLAIM)),
        errno::EINVAL
    );
    let big = vec![0u8; p.client.inject_size() + 1];
    assert_eq!(e(p.client.inject_write(&big, addr, key)), errno::EINVAL);
    assert_eq!(
        e(p.client.writedata(&local, 0, 8, 1 << 33, addr, key, 0)),
        errno::EINVAL
    );
    // Nothing was posted: both CQs stay empty, and the connection still works.
    assert!(p
        .client_cq
        .read(&mut [CqEntry::default(); 1])
        .unwrap_err()
        .is_again());
    local.write_at(0, b"still ok").unwrap();
    p.client.write(&local, 0, 8, addr, key, 9).unwrap();
    assert_eq!(wait_one(&p.client_cq).op_context, 9);
    let mut got = [0u8; 8];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"still ok");
}

#[test]
fn access_the_target_did_not_grant_is_an_error_completion_and_writes_nothing() {
    let Some(info) = device_info() else { return };
    // Each violation breaks its connection (RC moves the QP to error): a pair each.
    for case in ["write to a read-only region", "out of range", "stale key"] {
        let p = connect_pair(&info);
        let target = MemoryRegion::alloc(&p.domain, 4096, Flags::REMOTE_READ).unwrap();
        let writable = MemoryRegion::alloc(&p.domain, 4096, Flags::REMOTE_WRITE).unwrap();
        target.fill(0, 4096, 0x11).unwrap();
        writable.fill(0, 4096, 0x11).unwrap();
        let local = MemoryRegion::alloc(&p.domain, 4096, Flags::WRITE).unwrap();
        local.fill(0, 4096, 0xee).unwrap();
        let (addr, key) = match case {
            "write to a read-only region" => (target.addr(), target.key()),
            "out of range" => (writable.addr() + 4000, writable.key()),
            _ => {
                let gone = MemoryRegion::alloc(&p.domain, 4096, Flags::REMOTE_WRITE).unwrap();
                let k = (gone.addr(), gone.key());
                drop(gone);
                k
            }
        };
        p.client.write(&local, 0, 200, addr, key, 0x77).unwrap();
        let err = wait_err(&p.client_cq);
        assert_eq!(err.op_context, 0x77, "{case}");
        assert_eq!(err.err, errno::EACCES, "{case}");
        assert_eq!(
            Flags::from_bits_retain(err.flags),
            Flags::RMA | Flags::WRITE,
            "{case}"
        );
        let mut got = vec![0u8; 4096];
        for r in [&target, &writable] {
            r.read_at(0, &mut got).unwrap();
            assert!(
                got.iter().all(|b| *b == 0x11),
                "{case}: the target was written"
            );
        }
        // One posted, one completed (in error), nothing more.
        assert!(p
            .client_cq
            .read(&mut [CqEntry::default(); 1])
            .unwrap_err()
            .is_again());
    }
}
