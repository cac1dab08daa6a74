//! Device tests of completion queues (fi_cq(3)) on real verbs completions.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rfabric::core::cq::*;
use rfabric::verbs::*;
use rfabric::*;
use rfabric_sys::fabric::FI_ADDR_NOTAVAIL;

fn attr(format: CqFormat, wait_obj: WaitObj) -> CqAttr {
    CqAttr {
        format,
        wait_obj,
        ..Default::default()
    }
}

/// Polls `cq` until one entry of format `E` arrives.
fn one<E: FormatEntry>(cq: &CompletionQueue) -> E {
    let mut out = [E::default(); 1];
    let start = Instant::now();
    loop {
        match cq.read(&mut out) {
            Ok(1) => return out[0],
            Err(e) if e.is_again() => {}
            other => panic!("read: {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no completion");
    }
}

#[test]
fn every_format_carries_its_fields_on_real_completions() {
    let Some(info) = device_info() else { return };
    for format in [
        CqFormat::Context,
        CqFormat::Msg,
        CqFormat::Data,
        CqFormat::Tagged,
        CqFormat::Unspec,
    ] {
        let p = connect_pair_cq(&info, &attr(format, WaitObj::None));
        let m = MemoryRegion::alloc(&p.domain, 256, Flags::SEND | Flags::RECV).unwrap();
        m.write_at(0, b"format check").unwrap();
        p.server.recv(&m, 128, 128, 0x77).unwrap();
        p.client.senddata(&m, 0, 12, 0xabc, 0x66).unwrap();
        let mut got = [0u8; 12];
        match format {
            CqFormat::Context => {
                assert_eq!(one::<CqContextEntry>(&p.server_cq).op_context, 0x77);
                assert_eq!(one::<CqContextEntry>(&p.client_cq).op_context, 0x66);
            }
            CqFormat::Msg => {
                let r = one::<CqMsgEntry>(&p.server_cq);
                assert_eq!((r.op_context, r.len), (0x77, 12));
                assert_eq!(
                    Flags::from_bits_retain(r.flags),
                    Flags::MSG | Flags::RECV | Flags::REMOTE_CQ_DATA
                );
                let s = one::<CqMsgEntry>(&p.client_cq);
                assert_eq!(Flags::from_bits_retain(s.flags), Flags::MSG | Flags::SEND);
            }
            CqFormat::Data => {
                let r = one::<CqDataEntry>(&p.server_cq);
                assert_eq!((r.op_context, r.len, r.data), (0x77, 12, 0xabc));
                one::<CqDataEntry>(&p.client_cq);
            }
            CqFormat::Tagged | CqFormat::Unspec => {
                assert_eq!(
                    p.server_cq.attr().format,
                    CqFormat::Tagged,
                    "UNSPEC resolves to the tagged format"
                );
                let r = one::<CqEntry>(&p.server_cq);
                assert_eq!((r.op_context, r.len, r.data, r.tag), (0x77, 12, 0xabc, 0));
                one::<CqEntry>(&p.client_cq);
            }
        }
        m.read_at(128, &mut got).unwrap();
        assert_eq!(&got, b"format check");
        if format != CqFormat::Tagged && format != CqFormat::Unspec {
            let mut wrong = [CqEntry::default(); 1];
            assert_eq!(
                p.server_cq.read(&mut wrong).unwrap_err().errno(),
                errno::EINVAL,
                "reading another format"
            );
        }
    }
}

#[test]
fn readfrom_reports_no_source_on_connected_endpoints() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_cq(&info, &attr(CqFormat::Msg, WaitObj::None));
    let m = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&m, 32, 32, 1).unwrap();
    p.client.send(&m, 0, 4, 2).unwrap();
    let mut out = [CqMsgEntry::default(); 4];
    let mut src = [0u64; 4];
    let start = Instant::now();
    let n = loop {
        match p.server_cq.readfrom(&mut out, &mut src) {
            Ok(n) => break n,
            Err(e) if e.is_again() => assert!(start.elapsed() < Duration::from_secs(10)),
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!((n, out[0].op_context, src[0]), (1, 1, FI_ADDR_NOTAVAIL));
    assert_eq!(
        p.server_cq
            .readfrom(&mut out, &mut src[..1])
            .unwrap_err()
            .errno(),
        errno::EINVAL,
        "short source array"
    );
}

#[test]
fn a_receive_too_small_for_the_message_is_read_through_readerr() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 256, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&m, 128, 8, 0x51).unwrap();
    p.client.send(&m, 0, 100, 0x52).unwrap();
    let e = wait_err(&p.server_cq);
    assert_eq!(e.op_context, 0x51);
    // Hardware reports IBV_WC_LOC_LEN_ERR (FI_ETRUNC); rxe reports IBV_WC_LOC_QP_OP_ERR (FI_EIO).
    match e.prov_errno {
        1 => assert_eq!(
            (e.err, p.server_cq.strerror(1)),
            (errno::ETRUNC, "local length error")
        ),
        2 => assert_eq!(
            (e.err, p.server_cq.strerror(2)),
            (errno::EIO, "local QP operation error")
        ),
        other => panic!(
            "unexpected status {other} ({}) for {e:?}",
            p.server_cq.strerror(other)
        ),
    }
    assert_eq!(Flags::from_bits_retain(e.flags), Flags::MSG | Flags::RECV);
    // The sender learns it too: the receiver refused the request.
    let s = wait_err(&p.client_cq);
    assert_eq!(s.op_context, 0x52);
    assert!(
        s.err == errno::EINVAL || s.err == errno::EIO,
        "sender err {}",
        s.err
    );
    assert!(!p.client_cq.strerror(s.prov_errno).is_empty());
}

#[test]
fn error_data_is_readable_both_ways() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let m = MemoryRegion::alloc(&p.domain, 64, Flags::RECV).unwrap();
    p.server.recv(&m, 0, 64, 1).unwrap();
    p.server.recv(&m, 0, 64, 2).unwrap();
    p.client.shutdown().unwrap();
    // In manual progress the peer's disconnect is processed when the EQ is read.
    assert!(matches!(
        next_event(&p.server_eq),
        rfabric::core::eq::EqEvent::Shutdown { .. }
    ));
    let start = Instant::now();
    let mut out = [CqEntry::default(); 1];
    while p.server_cq.read(&mut out).map_err(|e| e.errno()) != Err(errno::EAVAIL) {
        assert!(start.elapsed() < Duration::from_secs(10), "no flush");
    }
    let mut buf = [0u8; 8];
    let (ctx, copied) = p
        .server_cq
        .readerr_with(Some(&mut buf), |e, d| {
            (e.op_context, d == ErrData::Copied(0))
        })
        .unwrap();
    assert_eq!((ctx, copied), (1, true), "verbs errors carry no error data");
    // The next error is reported when a read reaches it.
    while p.server_cq.read(&mut out).map_err(|e| e.errno()) != Err(errno::EAVAIL) {
        assert!(start.elapsed() < Duration::from_secs(10), "second flush");
    }
    let held = p
        .server_cq
        .readerr_with(None, |e, d| {
            (e.err, matches!(d, ErrData::Held(b) if b.is_empty()))
        })
        .unwrap();
    assert_eq!(held, (errno::ECANCELED, true));
}

#[test]
fn sread_needs_a_wait_object() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    let mut out = [CqEntry::default(); 1];
    assert_eq!(
        p.server_cq.sread(&mut out, 0, 10).unwrap_err().errno(),
        errno::EINVAL
    );
}

#[test]
fn a_thread_in_sread_is_woken_by_a_completion_by_signal_and_by_its_timeout() {
    let Some(info) = device_info() else { return };
    for wait in [
        WaitObj::Unspec,
        WaitObj::Fd,
        WaitObj::Yield,
        WaitObj::MutexCond,
    ] {
        let p = connect_pair_cq(&info, &attr(CqFormat::Tagged, wait));
        let m = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
        p.server.recv(&m, 32, 32, 9).unwrap();
        std::thread::scope(|s| {
            let cq = &p.server_cq;
            let waiter = s.spawn(move || {
                let mut out = [CqEntry::default(); 2];
                let n = cq.sread(&mut out, 0, 20_000).unwrap();
                (n, out[0].op_context, Instant::now())
            });
            std::thread::sleep(Duration::from_millis(300));
            // Timed here, not from the waiter's start: a thread scheduled late on a busy
            // machine must not read as an early return.
            let sent = Instant::now();
            p.client.send(&m, 0, 8, 1).unwrap();
            let (n, ctx, returned) = waiter.join().unwrap();
            assert_eq!((n, ctx), (1, 9), "{wait:?}");
            assert!(
                returned >= sent,
                "{wait:?}: returned {:?} before the send",
                sent - returned
            );
        });
        std::thread::scope(|s| {
            let cq = &p.server_cq;
            let waiter = s.spawn(move || {
                let mut out = [CqEntry::default(); 1];
                cq.sread(&mut out, 0, 20_000).map_err(|e| e.errno())
            });
            std::thread::sleep(Duration::from_millis(300));
            p.server_cq.signal();
            assert_eq!(
                waiter.join().unwrap(),
                Err(errno::EAGAIN),
                "{wait:?}: signal"
            );
        });
        let mut out = [CqEntry::default(); 1];
        let t = Instant::now();
        assert_eq!(
            p.server_cq.sread(&mut out, 0, 200).unwrap_err().errno(),
            errno::EAGAIN
        );
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "{wait:?}: timeout"
        );
        one::<CqEntry>(&p.client_cq);
    }
}

#[test]
fn threshold_sread_waits_for_that_many_completions() {
    let Some(info) = device_info() else { return };
    let a = CqAttr {
        wait_obj: WaitObj::Unspec,
        wait_cond: CqWaitCond::Threshold,
        ..Default::default()
    };
    let p = connect_pair_cq(&info, &a);
    let m = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    for i in 0..3 {
        p.server.recv(&m, 32, 32, i).unwrap();
    }
    std::thread::scope(|s| {
        let client = &p.client;
        let m = &m;
        s.spawn(move || {
            for i in 0..3 {
                std::thread::sleep(Duration::from_millis(100));
                client.send(m, 0, 4, 10 + i).unwrap();
            }
        });
        let mut out = [CqEntry::default(); 8];
        let mut n = 0;
        let t = Instant::now();
        while n < 3 {
            n += p.server_cq.sread(&mut out[n..], 3 - n, 10_000).unwrap();
        }
        assert!(
            t.elapsed() >= Duration::from_millis(250),
            "all three came after their sends"
        );
        assert_eq!(
            [out[0].op_context, out[1].op_context, out[2].op_context],
            [0, 1, 2]
        );
    });
}

#[test]
fn the_fd_wait_object_drives_epoll() {
    use nix::sys::epoll::*;
    let Some(info) = device_info() else { return };
    let p = connect_pair_cq(&info, &attr(CqFormat::Msg, WaitObj::Fd));
    assert_eq!(
        connect_pair_cq(&info, &attr(CqFormat::Msg, WaitObj::Unspec))
            .server_cq
            .wait_fd()
            .unwrap_err()
            .errno(),
        errno::EINVAL,
        "FI_GETWAIT is for FI_WAIT_FD"
    );
    let ep = Epoll::new(EpollCreateFlags::empty()).unwrap();
    ep.add(
        p.server_cq.wait_fd().unwrap(),
        EpollEvent::new(EpollFlags::EPOLLIN, 7),
    )
    .unwrap();
    let m = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&m, 32, 32, 5).unwrap();
    p.server_cq.trywait().unwrap();
    let mut ev = [EpollEvent::empty(); 1];
    assert_eq!(
        ep.wait(&mut ev, EpollTimeout::from(100u16)).unwrap(),
        0,
        "nothing yet"
    );
    p.client.send(&m, 0, 4, 1).unwrap();
    assert_eq!(
        ep.wait(&mut ev, EpollTimeout::from(10_000u16)).unwrap(),
        1,
        "readable after the completion"
    );
    assert_eq!(ev[0].data(), 7);
    let mut out = [CqMsgEntry::default(); 1];
    assert_eq!(p.server_cq.read(&mut out).unwrap(), 1);
    assert_eq!(out[0].op_context, 5);
    // A completion already queued: trywait says read instead of waiting.
    p.server.recv(&m, 32, 32, 6).unwrap();
    p.client.send(&m, 0, 4, 2).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(p.server_cq.trywait().unwrap_err().errno(), errno::EAGAIN);
    assert_eq!(p.server_cq.read(&mut out).unwrap(), 1);
}

#[test]
fn closing_a_cq_with_bound_endpoints_is_ebusy() {
    let Some(info) = device_info() else { return };
    let p = connect_pair(&info);
    assert_eq!(p.server_cq.close().unwrap_err().errno(), errno::EBUSY);
    let Pair {
        server, server_cq, ..
    } = p;
    drop(server);
    server_cq.close().unwrap();
}

#[test]
fn affinity_maps_the_signaling_vector_to_a_completion_vector() {
    let Some(info) = device_info() else { return };
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    for v in [0, 1, 7, 1000] {
        let a = CqAttr {
            flags: Flags::AFFINITY,
            signaling_vector: v,
            ..Default::default()
        };
        CompletionQueue::open(&domain, &a).unwrap();
    }
    let bad = CqAttr {
        flags: Flags::MULTI_RECV,
        ..Default::default()
    };
    assert_eq!(
        CompletionQueue::open(&domain, &bad).unwrap_err().errno(),
        errno::EBADFLAGS
    );
    let pollfd = CqAttr {
        wait_obj: WaitObj::PollFd,
        ..Default::default()
    };
    assert_eq!(
        CompletionQueue::open(&domain, &pollfd).unwrap_err().errno(),
        errno::ENOSYS
    );
    // A wait set's member: blocking reads go through the set (fi_cq(3)).
    let set = CqAttr {
        wait_obj: WaitObj::Set,
        ..Default::default()
    };
    let q = CompletionQueue::open(&domain, &set).unwrap();
    let mut e = [CqEntry::default(); 1];
    assert_eq!(q.sread(&mut e, 0, 0).unwrap_err().errno(), errno::EINVAL);
}

#[test]
fn software_completions_wake_the_fd_and_sread_and_keep_their_source() {
    use nix::sys::epoll::*;
    let Some(info) = device_info() else { return };
    let p = connect_pair_cq(&info, &attr(CqFormat::Tagged, WaitObj::Fd));
    let ep = Epoll::new(EpollCreateFlags::empty()).unwrap();
    ep.add(
        p.server_cq.wait_fd().unwrap(),
        EpollEvent::new(EpollFlags::EPOLLIN, 1),
    )
    .unwrap();
    p.server_cq.trywait().unwrap();
    let soft = CqEntry {
        op_context: 0x50f7,
        flags: (Flags::MSG | Flags::RECV).bits(),
        len: 3,
        ..Default::default()
    };
    p.server_cq.write(soft, 42).unwrap();
    let mut ev = [EpollEvent::empty(); 1];
    assert_eq!(
        ep.wait(&mut ev, EpollTimeout::from(5000u16)).unwrap(),
        1,
        "a software completion makes the fd readable"
    );
    let mut out = [CqEntry::default(); 2];
    let mut src = [0u64; 2];
    assert_eq!(p.server_cq.readfrom(&mut out, &mut src).unwrap(), 1);
    assert_eq!((out[0], src[0]), (soft, 42));
    // A thread in sread wakes for a software completion.
    std::thread::scope(|s| {
        let cq = &p.server_cq;
        let t = s.spawn(move || {
            let mut out = [CqEntry::default(); 1];
            cq.sread(&mut out, 0, 20_000)
                .map(|n| (n, out[0].op_context))
        });
        std::thread::sleep(Duration::from_millis(300));
        p.server_cq
            .write(
                CqEntry {
                    op_context: 7,
                    ..Default::default()
                },
                FI_ADDR_NOTAVAIL,
            )
            .unwrap();
        assert_eq!(t.join().unwrap().unwrap(), (1, 7));
    });
    // Error entries written in software come out of readerr in order.
    p.server_cq
        .writeerr(CqErrEntry {
            op_context: 8,
            err: errno::EIO,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(
        p.server_cq.read(&mut out).unwrap_err().errno(),
        errno::EAVAIL
    );
    assert_eq!(p.server_cq.readerr().unwrap().op_context, 8);
}

#[test]
fn the_mutex_cond_wait_object_is_broadcast_for_completions() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_cq(&info, &attr(CqFormat::Msg, WaitObj::MutexCond));
    assert_eq!(p.server_cq.wait_fd().unwrap_err().errno(), errno::EINVAL);
    let mc = p.server_cq.wait_mutex_cond().unwrap();
    let (m, c) = mc.as_ptrs();
    assert!(!m.is_null() && !c.is_null());
    let m_buf = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&m_buf, 32, 32, 3).unwrap();
    p.server_cq.trywait().unwrap();
    std::thread::scope(|s| {
        let mut g = mc.lock();
        let client = &p.client;
        let buf = &m_buf;
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            client.send(buf, 0, 4, 1).unwrap();
        });
        let t = Instant::now();
        assert!(
            g.wait(Some(Duration::from_secs(20))),
            "no broadcast for the completion"
        );
        assert!(t.elapsed() >= Duration::from_millis(250));
    });
    let mut out = [CqMsgEntry::default(); 1];
    let start = Instant::now();
    while p.server_cq.read(&mut out).is_err() {
        assert!(start.elapsed() < Duration::from_secs(5));
    }
    assert_eq!(out[0].op_context, 3);
    // Software completions broadcast too.
    p.server_cq.trywait().unwrap();
    std::thread::scope(|s| {
        let mut g = mc.lock();
        let cq = &p.server_cq;
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            cq.write(
                CqEntry {
                    op_context: 4,
                    ..Default::default()
                },
                FI_ADDR_NOTAVAIL,
            )
            .unwrap();
        });
        assert!(
            g.wait(Some(Duration::from_secs(20))),
            "no broadcast for a software completion"
        );
    });
}

/// What the system has available, from /proc/meminfo (KiB).
fn mem_available_kib() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn rss_kib() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// As fabtests' CQ test does: open `domain_attr.cq_cnt` CQs of the provider's default size
/// with `FI_WAIT_UNSPEC`, falling back to `FI_WAIT_NONE` when a wait object cannot be made
/// (file descriptors run out: a clean `-FI_EMFILE`, nothing else). Every one opens, and an
/// idle CQ costs little: what it costs is printed, for the README.
#[test]
fn as_many_cqs_as_cq_cnt_open_and_an_idle_one_costs_little() {
    let Some(info) = device_info() else { return };
    let fabric = Fabric::open(&info.fabric_attr).unwrap();
    let domain = Domain::open(&fabric, &info).unwrap();
    let want = info.domain_attr.cq_cnt;
    assert!(want > 0);
    let (avail, rss) = (mem_available_kib(), rss_kib());
    let mut cqs = Vec::with_capacity(want);
    let mut fallbacks = 0;
    for _ in 0..want {
        let cq = match CompletionQueue::open(&domain, &attr(CqFormat::Context, WaitObj::Unspec)) {
            Ok(cq) => cq,
            Err(e) => {
                assert!(
                    [errno::EMFILE, errno::ENOMEM].contains(&e.errno()),
                    "fi_cq_open failed with {e}, not a clean -FI_EMFILE/-FI_ENOMEM"
                );
                fallbacks += 1;
                CompletionQueue::open(&domain, &attr(CqFormat::Context, WaitObj::None))
                    .unwrap_or_else(|e| panic!("CQ {} of {want}: {e}", cqs.len() + 1))
            }
        };
        cqs.push(cq);
    }
    let sys_kib = avail.saturating_sub(mem_available_kib()) as f64 / want as f64;
    let rss_per = rss_kib().saturating_sub(rss) as f64 / want as f64;
    println!(
        "IDLE CQ: {want} CQs open ({fallbacks} without a wait object: descriptors ran out); \
         an idle CQ costs {sys_kib:.1} KiB of system memory, {rss_per:.1} KiB resident in the process"
    );
    // A generous ceiling (the issue saw a 6 GiB VM killed): 64 KiB of the system each.
    assert!(sys_kib < 64.0, "an idle CQ costs {sys_kib:.1} KiB");
    // They still work: the last one reads empty.
    let mut e = [CqContextEntry::default(); 1];
    assert!(cqs.last().unwrap().read(&mut e).unwrap_err().is_again());
    drop(cqs);
}

/// rxe frees a receive queue slot when its message lands, not when the completion is read:
/// an application that keeps posting receives and never reads its CQ fills the device
/// queue, and the device drops what does not fit (raising `IBV_EVENT_CQ_ERR`). The CQ says
/// so as fi_cq(3) asks: the completions it kept, then `FI_EOVERRUN`, never a silent loss.
#[test]
fn a_device_cq_overrun_is_reported_after_the_completions_it_kept() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_cq(
        &info,
        &CqAttr {
            size: 16,
            ..Default::default()
        },
    );
    let tx = MemoryRegion::alloc(&p.domain, 64, Flags::SEND).unwrap();
    let rx = MemoryRegion::alloc(&p.domain, 64, Flags::RECV).unwrap();
    let cap = p.server_cq.capacity();
    let mut out = [CqEntry::default(); 16];
    let (mut posted, mut sent, mut stop) = (0usize, 0usize, false);
    let start = Instant::now();
    // Rounds of: the server posts receives until its queue is full, the client sends that
    // many, and they land (rxe frees their slots) while nobody reads the server's CQ.
    while !stop && sent <= 2 * cap + 64 && start.elapsed() < Duration::from_secs(60) {
        let mut round = 0;
        loop {
            match p.server.recv(&rx, 0, 64, 1) {
                Ok(()) => round += 1,
                Err(e) if e.is_again() => break,
                Err(e) => panic!("recv: {e}"),
            }
        }
        posted += round;
        let mut left = round;
        let mut last = Instant::now();
        while left > 0 && !stop {
            match p.client.send(&tx, 0, 8, 2) {
                Ok(()) => {
                    left -= 1;
                    sent += 1;
                    last = Instant::now();
                }
                // Once the server's queue pair broke (its CQ overran) nothing completes.
                Err(e) if e.is_again() && last.elapsed() > Duration::from_secs(3) => stop = true,
                Err(e) if e.is_again() => {}
                Err(e) => panic!("send: {e}"),
            }
            // The client's own completions free its queue; once the server's queue pair
            // broke they are errors, which end the test's sending.
            if let Err(e) = p.client_cq.read(&mut out) {
                stop |= e.errno() == errno::EAVAIL;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        posted > cap,
        "only {posted} receives posted for a CQ of {cap}"
    );
    // What the server's CQ kept, then the overrun; never EAGAIN as if nothing was lost.
    let mut got = 0;
    let end = Instant::now() + Duration::from_secs(30);
    let overrun = loop {
        match p.server_cq.read(&mut out) {
            Ok(n) => got += n,
            Err(e) if e.is_again() && Instant::now() < end => {}
            Err(e) if e.errno() == errno::EAVAIL => {
                p.server_cq.readerr().unwrap();
            }
            Err(e) => break e,
        }
    };
    assert_eq!(
        overrun.errno(),
        errno::EOVERRUN,
        "{got} of {sent} receives completed, then: {overrun}"
    );
    // rxe rounds its ring up to a power of two: up to twice the entries asked for fit.
    assert!(got <= 2 * cap, "{got} completions read from a CQ of {cap}");
    assert!(
        got < sent,
        "{got} of {sent} completions read: nothing overflowed"
    );
    assert_eq!(
        p.server_cq.read(&mut out).unwrap_err().errno(),
        errno::EOVERRUN,
        "an overrun CQ stays overrun"
    );
    eprintln!("{posted} posted, {sent} sent, {got} kept in a CQ of {cap}, then FI_EOVERRUN");
}
