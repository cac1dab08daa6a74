//! Device tests of completion counters (`fi_cntr`) on MSG endpoints, under SoftRoCE.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rfabric::core::cq::CqEntry;
use rfabric::verbs::*;
use rfabric::*;

fn cq_is_empty(cq: &CompletionQueue) -> bool {
    cq.read(&mut [CqEntry::default(); 1])
        .is_err_and(|e| e.is_again())
}

fn unspec() -> CntrAttr {
    CntrAttr {
        wait_obj: WaitObj::Unspec,
        ..Default::default()
    }
}

#[test]
fn counters_count_sends_and_receives_that_make_no_cq_entry() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_full(
        &info,
        &PairOpts {
            bind: Flags::SELECTIVE_COMPLETION,
            cntr: Some((Flags::SEND, Flags::RECV)),
            ..Default::default()
        },
        b"",
        b"",
        |_, _, _| {},
    );
    let (tx, rx) = (
        p.client_cntr.clone().unwrap(),
        p.server_cntr.clone().unwrap(),
    );
    let src = MemoryRegion::alloc(&p.domain, 64 * 64, Flags::SEND).unwrap();
    let dst = MemoryRegion::alloc(&p.domain, 64 * 64, Flags::RECV).unwrap();
    const N: usize = 48;
    for i in 0..N {
        p.server.recv(&dst, 64 * i, 64, i as u64).unwrap();
    }
    // A third plain sends, a third injects, a third with FI_MORE chained: none asks for a
    // CQ entry, every one is counted.
    for i in 0..N {
        let data = pattern(64, i as u8);
        match i % 3 {
            0 => {
                src.write_at(64 * i, &data).unwrap();
                p.client.send(&src, 64 * i, 64, i as u64).unwrap()
            }
            1 => p.client.inject(&data).unwrap(),
            _ => {
                src.write_at(64 * i, &data).unwrap();
                let more = if i + 1 < N {
                    Flags::MORE
                } else {
                    Flags::empty()
                };
                p.client
                    .sendmsgv(&[(&src, 64 * i, 64)], i as u64, 0, more)
                    .unwrap()
            }
        }
    }
    tx.wait(N as u64, 10_000).unwrap();
    rx.wait(N as u64, 10_000).unwrap();
    assert_eq!((tx.read(), rx.read()), (N as u64, N as u64));
    assert_eq!((tx.readerr(), rx.readerr()), (0, 0));
    for i in 0..N {
        let mut got = [0u8; 64];
        dst.read_at(64 * i, &mut got).unwrap();
        assert!(got[..] == pattern(64, i as u8)[..], "message {i}");
    }
    assert!(cq_is_empty(&p.client_cq) && cq_is_empty(&p.server_cq));

    // One that asks (FI_COMPLETION) reaches the CQ as well, after the counter drove it.
    p.server.recv(&dst, 0, 64, 0x77).unwrap();
    p.client
        .sendmsgv(&[(&src, 0, 8)], 0x88, 0, Flags::COMPLETION)
        .unwrap();
    tx.wait(N as u64 + 1, 10_000).unwrap();
    assert_eq!(wait_one(&p.client_cq).op_context, 0x88);
    rx.wait(N as u64 + 1, 10_000).unwrap();
    assert!(cq_is_empty(&p.server_cq));

    // The counters are bound: they do not close until the endpoints are gone.
    assert_eq!(tx.close().unwrap_err().errno(), errno::EBUSY);
    let Pair { client, server, .. } = p;
    drop(client);
    drop(server);
    tx.close().unwrap();
    rx.close().unwrap();
}

#[test]
fn counters_count_rma_and_an_error_ends_a_wait() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_full(
        &info,
        &PairOpts {
            bind: Flags::SELECTIVE_COMPLETION,
            cntr: Some((Flags::READ | Flags::WRITE, Flags::RECV)),
            ..Default::default()
        },
        b"",
        b"",
        |_, _, _| {},
    );
    let (rma, rx) = (
        p.client_cntr.clone().unwrap(),
        p.server_cntr.clone().unwrap(),
    );
    let target =
        MemoryRegion::alloc(&p.domain, 8192, Flags::REMOTE_WRITE | Flags::REMOTE_READ).unwrap();
    let local = MemoryRegion::alloc(&p.domain, 8192, Flags::WRITE | Flags::READ).unwrap();
    let (addr, key) = (target.addr(), target.key());
    for i in 0..4u64 {
        local
            .write_at(1024 * i as usize, &pattern(1000, i as u8))
            .unwrap();
        p.client
            .write(&local, 1024 * i as usize, 1000, addr + 1024 * i, key, i)
            .unwrap();
    }
    p.client
        .inject_write(b"injected", addr + 5000, key)
        .unwrap();
    p.client.read(&local, 6000, 1000, addr, key, 9).unwrap();
    rma.wait(6, 10_000).unwrap();
    assert_eq!(rma.read(), 6);
    let mut got = vec![0u8; 1000];
    for i in 0..4 {
        target.read_at(1024 * i, &mut got).unwrap();
        assert!(got == pattern(1000, i as u8), "write {i}");
    }
    local.read_at(6000, &mut got).unwrap();
    assert!(got == pattern(1000, 0), "the read");
    let mut inj = [0u8; 8];
    target.read_at(5000, &mut inj).unwrap();
    assert_eq!(&inj, b"injected");
    assert!(cq_is_empty(&p.client_cq));

    // A write with remote CQ data consumes a receive, but is no message: FI_RECV does not
    // count it (FI_REMOTE_WRITE would, with FI_RMA_EVENT, which rverbs does not offer).
    let rbuf = MemoryRegion::alloc(&p.domain, 64, Flags::RECV).unwrap();
    p.server
        .recvmsg(&rbuf, 0, 64, 0x51, Flags::COMPLETION)
        .unwrap();
    p.client
        .writedata(&local, 0, 16, 0xd47a, addr, key, 10)
        .unwrap();
    let r = wait_one(&p.server_cq);
    assert_eq!((r.op_context, r.data), (0x51, 0xd47a));
    assert_eq!(rx.read(), 0);
    assert_eq!(rma.read(), 7);

    // An access the target did not grant: the error count moves, and a wait for more
    // successes returns EAVAIL at once instead of its timeout.
    let ro = MemoryRegion::alloc(&p.domain, 4096, Flags::REMOTE_READ).unwrap();
    p.client
        .write(&local, 0, 64, ro.addr(), ro.key(), 0x99)
        .unwrap();
    let t = Instant::now();
    let e = rma.wait(100, 20_000).unwrap_err();
    assert_eq!(e.errno(), errno::EAVAIL);
    assert!(t.elapsed() < Duration::from_secs(10));
    assert_eq!((rma.read(), rma.readerr()), (7, 1));
    let err = wait_err(&p.client_cq);
    assert_eq!((err.op_context, err.err), (0x99, errno::EACCES));
}

#[test]
fn a_blocked_wait_wakes_for_a_completion_and_for_another_threads_add() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_full(
        &info,
        &PairOpts {
            cntr: Some((Flags::SEND, Flags::RECV)),
            // CQs with a descriptor: the counter's nests them.
            cq_attr: CqAttr {
                wait_obj: WaitObj::Unspec,
                ..Default::default()
            },
            ..Default::default()
        },
        b"",
        b"",
        |_, _, _| {},
    );
    let rx = p.server_cntr.clone().unwrap();
    let mr = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&mr, 0, 64, 1).unwrap();
    let took = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            p.client.inject(b"wake up").unwrap();
        });
        let t = Instant::now();
        rx.wait(1, 20_000).unwrap();
        t.elapsed()
    });
    assert!(took >= Duration::from_millis(290), "{took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    // It slept on the counter's descriptor until the completion woke it, where 1 ms
    // slices would have looked 300 times.
    let woke = rx.wakeups();
    assert!((1..=20).contains(&woke), "the wait woke {woke} times");
    assert_eq!(rx.read(), 1);
    assert_eq!(wait_one(&p.server_cq).op_context, 1);

    let took = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            rx.add(2);
        });
        let t = Instant::now();
        rx.wait(3, 20_000).unwrap();
        t.elapsed()
    });
    assert!(took < Duration::from_secs(10), "{took:?}");
    let woke = rx.wakeups() - woke;
    assert!(woke <= 20, "the add woke the wait: {woke} looks");
    let t = Instant::now();
    assert_eq!(rx.wait(4, 50).unwrap_err().errno(), errno::ETIMEDOUT);
    assert!(t.elapsed() >= Duration::from_millis(50));
    assert_eq!(rx.read(), 3);
}

#[test]
fn a_mutex_cond_counters_pair_is_broadcast_when_progress_counts_a_completion() {
    let Some(info) = device_info() else { return };
    let p = connect_pair_full(
        &info,
        &PairOpts {
            cntr: Some((Flags::SEND, Flags::RECV)),
            cntr_wait: Some(WaitObj::MutexCond),
            ..Default::default()
        },
        b"",
        b"",
        |_, _, _| {},
    );
    let rx = p.server_cntr.clone().unwrap();
    assert!(
        p.client_cntr.as_ref().unwrap().wait_fd().is_err(),
        "no descriptor"
    );
    let mc = rx.wait_mutex_cond().unwrap();
    let mr = MemoryRegion::alloc(&p.domain, 64, Flags::SEND | Flags::RECV).unwrap();
    p.server.recv(&mr, 0, 64, 1).unwrap();
    let (woken, took, entry) = std::thread::scope(|s| {
        let mut g = mc.lock();
        // Once this thread sleeps (the mutex is free), another sends and drives the
        // server's CQ (manual progress) until the receive completes: that counts it.
        let driver = s.spawn(|| {
            drop(mc.lock());
            p.client.inject(b"counted").unwrap();
            wait_one(&p.server_cq)
        });
        let t = Instant::now();
        let woken = g.wait(Some(Duration::from_secs(20)));
        drop(g);
        (woken, t.elapsed(), driver.join().unwrap())
    });
    assert!(woken, "the pair was not broadcast within 20 s");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_eq!(entry.op_context, 1);
    assert_eq!(rx.read(), 1);
}

#[test]
fn binds_and_calls_the_man_pages_refuse_are_errors() {
    let Some(info) = device_info() else { return };
    assert!(info.domain_attr.cntr_cnt > 0, "MSG infos offer counters");
    let p = connect_pair(&info);
    let c = Counter::open(&p.domain, &unspec()).unwrap();
    // Bound after enable.
    assert_eq!(
        p.client.bind_cntr(&c, Flags::SEND).unwrap_err().errno(),
        errno::EOPBADSTATE
    );
    // Before enable: an unenabled endpoint of the same domain.
    let mut i = info.clone();
    i.dest_addr = p.client.getpeer();
    let ep = MsgEndpoint::open(&p.domain, &i, 7).unwrap();
    assert_eq!(
        ep.bind_cntr(&c, Flags::REMOTE_WRITE).unwrap_err().errno(),
        errno::EINVAL
    );
    assert_eq!(
        ep.bind_cntr(&c, Flags::SELECTIVE_COMPLETION)
            .unwrap_err()
            .errno(),
        errno::EBADFLAGS
    );
    assert_eq!(
        ep.bind_cntr(&c, Flags::empty()).unwrap_err().errno(),
        errno::EBADFLAGS
    );
    ep.bind_cntr(&c, Flags::SEND | Flags::WRITE).unwrap();
    let other = Counter::open(&p.domain, &unspec()).unwrap();
    assert_eq!(
        ep.bind_cntr(&other, Flags::WRITE).unwrap_err().errno(),
        errno::EINVAL,
        "one counter per direction"
    );
    ep.bind_cntr(&other, Flags::RECV | Flags::READ).unwrap();
    assert_eq!(c.close().unwrap_err().errno(), errno::EBUSY);
    drop(ep);
    c.close().unwrap();
    other.close().unwrap();
    let ep = MsgEndpoint::open(&p.domain, &i, 8).unwrap();
    assert_eq!(
        ep.bind_cntr(&c, Flags::SEND).unwrap_err().errno(),
        errno::EINVAL,
        "a closed counter"
    );

    let none = Counter::open(&p.domain, &CntrAttr::default()).unwrap();
    assert_eq!(none.wait(0, 0).unwrap_err().errno(), errno::EINVAL);
    let flagged = CntrAttr {
        flags: Flags::SEND,
        ..unspec()
    };
    assert_eq!(
        Counter::open(&p.domain, &flagged).unwrap_err().errno(),
        errno::EINVAL
    );
    let pollfd = CntrAttr {
        wait_obj: WaitObj::PollFd,
        ..Default::default()
    };
    assert_eq!(
        Counter::open(&p.domain, &pollfd).unwrap_err().errno(),
        errno::ENOSYS
    );
    // The value calls: read, add, set and their error twins.
    let v: Arc<Counter> = Counter::open(&p.domain, &unspec()).unwrap();
    v.add(5);
    v.add(6);
    v.adderr(2);
    assert_eq!((v.read(), v.readerr()), (11, 2));
    v.set(1);
    v.seterr(0);
    assert_eq!((v.read(), v.readerr()), (1, 0));
    v.wait(1, 0).unwrap();
}
