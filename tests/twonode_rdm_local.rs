//! One RDM endpoint for local and remote peers (issue 18), on two SoftRoCE nodes
//! (`ci/vm-run-2node`): node 0 runs two processes (this test and a child it starts), node 1
//! one. Each sends every other one tagged messages of every protocol size and an untagged
//! one, through one endpoint, one CQ and one AV; bytes and sources are checked, the local
//! pair's messages go over the shm peer inside the endpoints and open no verbs connection,
//! and the remote ones go over verbs and never through shm.
//!
//! Without `RFABRIC_NODE` (set by the two-node runner) these skip: they need a second node.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rfabric::core::cq::CqEntry;
use rfabric::verbs::*;
use rfabric::*;

/// Every protocol's sizes: verbs' eager, segmented and rendezvous; shm's inline, inject
/// and CMA copies.
const SIZES: [usize; 5] = [8, 4096, 6000, 30_000, 300_000];
/// Where node 1 takes node 0's names and answers with its own.
const NAMES_PORT: u16 = 24_517;

struct Ep {
    ep: RdmEndpoint,
    cq: Arc<CompletionQueue>,
    av: Arc<AddressVector>,
    domain: Arc<Domain>,
}

fn open_ep() -> Ep {
    let mut hints = Info::default();
    hints.ep_attr.ep_type = EpType::Rdm;
    hints.caps = Flags::TAGGED | Flags::MSG | Flags::SOURCE | Flags::DIRECTED_RECV;
    let info = getinfo(None, None, Flags::empty(), Some(&hints))
        .unwrap()
        .remove(0);
    let (domain, cq) = domain_and_tagged_cq(&info);
    let av = AddressVector::open(&domain, &AvAttr::default()).unwrap();
    let ep = RdmEndpoint::open(&domain, &info).unwrap();
    ep.bind_cq(&cq, Flags::TRANSMIT | Flags::RECV).unwrap();
    ep.bind_av(&av).unwrap();
    ep.enable().unwrap();
    assert!(rfabric::capi::ext::local::import_shm(&ep).unwrap());
    Ep { ep, cq, av, domain }
}

/// Node 0's side of the names' exchange: node 1 listens on `port` once it is up (each node
/// runs on its own clock).
fn connect_to_node1(peer: &str, port: u16) -> TcpStream {
    let t = Instant::now();
    loop {
        match TcpStream::connect((peer, port)) {
            Ok(s) => return s,
            Err(_) if t.elapsed() < Duration::from_secs(120) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(err) => panic!("node 1 never listened on {port}: {err}"),
        }
    }
}

/// This node's part of a two-node test: its index, the other node's and its own address,
/// its endpoint and name.
struct Start {
    node: String,
    peer: String,
    own: String,
    e: Ep,
    name: String,
}

/// `None` (the test skips) outside the two-node runner.
fn start() -> Option<Start> {
    let node = std::env::var("RFABRIC_NODE").ok()?;
    let e = open_ep();
    Some(Start {
        node,
        peer: std::env::var("RFABRIC_PEER_ADDR").expect("RFABRIC_PEER_ADDR"),
        own: std::env::var("RFABRIC_SELF_ADDR").expect("RFABRIC_SELF_ADDR"),
        name: hex(&e.ep.getname().unwrap().to_bytes()),
        e,
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn sizes_between(_a: usize, _b: usize) -> &'static [usize] {
    &SIZES
}

fn tag_of(from: usize, k: usize) -> u64 {
    ((from as u64) << 32) | k as u64
}

fn seed_of(from: usize, to: usize, k: usize) -> u8 {
    (from * 31 + to * 7 + k) as u8
}

/// Exchanges with the other two: every size tagged, one untagged; returns when all of its
/// sends completed and all it expects arrived, bytes and sources checked.
fn traffic(me: usize, e: &Ep) {
    let peers: Vec<usize> = (0..3).filter(|&p| p != me).collect();
    let rx = MemoryRegion::alloc(&e.domain, 2 << 20, Flags::RECV).unwrap();
    let tx = MemoryRegion::alloc(&e.domain, 1 << 20, Flags::SEND).unwrap();
    // Receives first for one peer, the other's messages arrive unexpected.
    let mut at = 0;
    let mut want = Vec::new();
    for &p in &peers {
        for (k, &n) in sizes_between(p, me).iter().enumerate() {
            e.ep.trecv(
                RecvBuf::region(&rx, at, n).unwrap(),
                p as u64,
                tag_of(p, k),
                0,
                want.len() as u64,
            )
            .unwrap();
            want.push((p, k, n, at));
            at += n;
        }
        e.ep.recv(
            RecvBuf::region(&rx, at, 64).unwrap(),
            p as u64,
            want.len() as u64,
        )
        .unwrap();
        want.push((p, usize::MAX, 50, at));
        at += 64;
    }
    // Every send from its own place in one region, all posted before any is reaped.
    let mut sends = 0;
    let mut off = 0;
    for &p in &peers {
        for (k, &n) in sizes_between(me, p).iter().enumerate() {
            tx.write_at(off, &pattern(n, seed_of(me, p, k))).unwrap();
            post(e, || {
                e.ep.send_region(
                    &tx,
                    off,
                    n,
                    p as u64,
                    Some(tag_of(me, k)),
                    1000,
                    Flags::empty(),
                )
            });
            off += n;
            sends += 1;
        }
        post(e, || {
            e.ep.send(&pattern(50, seed_of(me, p, 99)), p as u64, 1001)
        });
        sends += 1;
    }
    let mut got = vec![false; want.len()];
    let t = Instant::now();
    while got.iter().any(|g| !g) || sends > 0 {
        let mut c = [CqEntry::default(); 8];
        let mut src = [0u64; 8];
        match e.cq.readfrom(&mut c, &mut src) {
            Ok(n) => {
                for (c, &s) in c[..n].iter().zip(&src) {
                    if c.flags & Flags::SEND.bits() != 0 {
                        sends -= 1;
                        continue;
                    }
                    let i = c.op_context as usize;
                    let (p, k, n, at) = want[i];
                    assert_eq!(s, p as u64, "FI_SOURCE of message {i} from {p}");
                    assert_eq!(c.len, n);
                    let mut b = vec![0u8; n];
                    rx.read_at(at, &mut b).unwrap();
                    let seed = seed_of(p, me, if k == usize::MAX { 99 } else { k });
                    assert!(b == pattern(n, seed), "{n} bytes from {p} differ");
                    got[i] = true;
                }
            }
            Err(err) if err.is_again() => {}
            Err(err) => panic!("{err}: {:?}", e.cq.readerr()),
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "process {me}: {} of {} messages arrived, {sends} sends not completed",
            got.iter().filter(|g| **g).count(),
            got.len()
        );
    }
}

/// Posts while the call says -FI_EAGAIN (shm's first send waits for its handshake),
/// reading the CQ meanwhile.
fn post(e: &Ep, mut f: impl FnMut() -> Result<()>) {
    let t = Instant::now();
    loop {
        match f() {
            Err(err) if err.is_again() && t.elapsed() < Duration::from_secs(60) => {
                let mut none: [CqEntry; 0] = [];
                let _ = e.cq.read(&mut none);
            }
            r => return r.unwrap(),
        }
    }
}

/// The second process on node 0 (started by the test on node 0, never on its own).
#[test]
#[ignore]
fn local_peer_process() {
    if std::env::var("RFABRIC_LOCAL_PEER").is_err() {
        return;
    }
    let e = open_ep();
    println!("LOCAL NAME {}", hex(&e.ep.getname().unwrap().to_bytes()));
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    for n in line.split_whitespace() {
        e.av.insert(&unhex(n)).unwrap();
    }
    traffic(1, &e);
    let (sent, arrived) = e.ep.local_messages();
    println!(
        "LOCAL DONE {} {} {sent} {arrived}",
        u8::from(e.ep.connected(0)),
        u8::from(e.ep.connected(2))
    );
    // Stays until told: its peers may still read what it sent.
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn local_and_remote_peers_share_one_endpoint() {
    let Some(Start {
        node,
        peer,
        own,
        e,
        name,
    }) = start()
    else {
        return;
    };
    if node == "1" {
        // Node 1: process 2. Takes node 0's two names, answers with its own.
        let l = TcpListener::bind((own.as_str(), NAMES_PORT)).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut line = String::new();
        BufReader::new(s.try_clone().unwrap())
            .read_line(&mut line)
            .unwrap();
        writeln!(s, "{name}").unwrap();
        let names: Vec<_> = line.split_whitespace().map(String::from).collect();
        assert_eq!(names.len(), 2);
        for n in names.iter().chain([&name]) {
            e.av.insert(&unhex(n)).unwrap();
        }
        traffic(2, &e);
        assert_eq!(
            e.ep.local_messages(),
            (0, 0),
            "nothing of node 1 goes over shm"
        );
        assert!(
            e.ep.connected(0) && e.ep.connected(1),
            "an RC connection per remote peer"
        );
        // Done when node 0 says so (its processes may still read what this one sent).
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        return;
    }
    // Node 0: processes 0 (this one) and 1 (a child).
    let (mut child, mut lines, local) = spawn_child(
        "local_peer_process",
        ("RFABRIC_LOCAL_PEER", "1"),
        "LOCAL NAME ",
    );
    let mut s = connect_to_node1(&peer, NAMES_PORT);
    writeln!(s, "{name} {local}").unwrap();
    let mut remote = String::new();
    BufReader::new(s.try_clone().unwrap())
        .read_line(&mut remote)
        .unwrap();
    let remote = remote.trim().to_string();
    writeln!(child.stdin.as_mut().unwrap(), "{name} {local} {remote}").unwrap();
    for n in [&name, &local, &remote] {
        e.av.insert(&unhex(n)).unwrap();
    }
    traffic(0, &e);
    let done = lines
        .by_ref()
        .map_while(|l| l.ok())
        .find_map(|l| {
            l.find("LOCAL DONE ")
                .map(|i| l[i + 11..].trim().to_string())
        })
        .expect("the local peer finished");
    let v: Vec<u64> = done
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    // The local pair: everything between them over shm (no verbs connection between
    // them), and only that; node 1 over verbs.
    let between = SIZES.len() as u64 + 1;
    assert_eq!(
        v,
        vec![0, 1, between, between],
        "the local peer: connected to 0, connected to 2, sent and arrived over shm"
    );
    assert!(!e.ep.connected(1), "no verbs connection to the local peer");
    assert!(e.ep.connected(2), "a verbs connection to node 1");
    assert_eq!(e.ep.local_messages(), (between, between));
    writeln!(child.stdin.as_mut().unwrap()).unwrap();
    drop(s);
    assert!(child.wait().unwrap().success());
}

/// Where node 0 and node 1 meet for the killed-peer test.
const KILL_PORT: u16 = 24_518;
/// Fixed places in the AV of every process of the killed-peer test.
const S: u64 = 0;
const L: u64 = 1;
const LV: u64 = 2;
const R: u64 = 3;
const RV: u64 = 4;
/// The victims' stream.
const STREAM: u64 = 7;
/// What the others send the survivor once the victims are dead.
const AFTER: u64 = 8;

/// A child process of this test binary.
type Child = (std::process::Child, ChildLines, String);

/// Starts the ignored test `test` of this binary as a child (with `env` set) and reads the
/// name it prints after `marker`.
fn spawn_child(test: &str, env: (&str, &str), marker: &str) -> Child {
    spawn_test_child(test, &[env], marker)
}

/// A child of the killed-peer test in `role` (`stay` or `victim`).
fn spawn_peer(role: &str) -> Child {
    spawn_child(
        "killed_test_peer",
        ("RFABRIC_KILLED_ROLE", role),
        "PEER NAME ",
    )
}

fn insert_all(e: &Ep, names: &str) {
    for (i, n) in names.split_whitespace().enumerate() {
        assert_eq!(e.av.insert(&unhex(n)).unwrap(), i as u64);
    }
}

/// Sends the survivor `AFTER` messages of every size, then waits for their completions
/// and for the survivor's message to it, bytes checked.
fn answer_survivor(e: &Ep, me: u64) {
    let rx = MemoryRegion::alloc(&e.domain, 1 << 20, Flags::RECV).unwrap();
    e.ep.trecv(RecvBuf::region(&rx, 0, 1 << 20).unwrap(), S, AFTER, 0, 1)
        .unwrap();
    let tx = MemoryRegion::alloc(&e.domain, 1 << 20, Flags::SEND).unwrap();
    let mut off = 0;
    for (k, &n) in SIZES.iter().enumerate() {
        tx.write_at(off, &pattern(n, seed_of(me as usize, 0, k)))
            .unwrap();
        post(e, || {
            e.ep.send_region(&tx, off, n, S, Some(AFTER), 100 + k as u64, Flags::empty())
        });
        off += n;
    }
    let (mut sends, mut got) = (0, false);
    let t = Instant::now();
    while sends < SIZES.len() || !got {
        let mut c = [CqEntry::default(); 8];
        match e.cq.read(&mut c) {
            Ok(n) => {
                for c in &c[..n] {
                    if c.flags & Flags::SEND.bits() != 0 {
                        sends += 1;
                    } else {
                        assert_eq!(c.len, 64);
                        let mut b = vec![0u8; 64];
                        rx.read_at(0, &mut b).unwrap();
                        assert!(b == pattern(64, me as u8), "the survivor's message");
                        got = true;
                    }
                }
            }
            Err(err) if err.is_again() => {}
            Err(err) => panic!("{err}: {:?}", e.cq.readerr()),
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{sends} sends, got {got}"
        );
    }
}

/// The children of the killed-peer test: a local peer that stays (`stay`) or a victim that
/// streams to the survivor until it is killed (`victim`).
#[test]
#[ignore]
fn killed_test_peer() {
    let Ok(role) = std::env::var("RFABRIC_KILLED_ROLE") else {
        return;
    };
    let e = open_ep();
    println!("PEER NAME {}", hex(&e.ep.getname().unwrap().to_bytes()));
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    insert_all(&e, &line);
    if role == "victim" {
        let msg = pattern(100, 3);
        let mut k = 0u64;
        loop {
            // 200 at most: the survivor takes five, the rest wait there unexpected.
            if k < 200 {
                match e.ep.tsend(&msg, STREAM, S, k) {
                    Ok(()) => k += 1,
                    Err(err) if err.is_again() => {}
                    Err(err) => panic!("{err}"),
                }
            }
            let mut c = [CqEntry::default(); 8];
            let _ = e.cq.read(&mut c);
        }
    }
    // Stays: answers once the survivor says so (a line on stdin), then waits to be told.
    line.clear();
    std::io::stdin().read_line(&mut line).unwrap();
    answer_survivor(&e, L);
    println!("PEER DONE");
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn a_killed_local_or_remote_peer_leaves_the_survivor_working_with_the_others() {
    let Some(Start {
        node,
        peer,
        own,
        e,
        name,
    }) = start()
    else {
        return;
    };
    if node == "1" {
        // R, with its victim RV.
        let (mut rv, _rv_lines, rv_name) = spawn_peer("victim");
        let l = TcpListener::bind((own.as_str(), KILL_PORT)).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        writeln!(s, "{name} {rv_name}").unwrap();
        let all = format!("{} {name} {rv_name}", line.trim());
        writeln!(rv.stdin.as_mut().unwrap(), "{all}").unwrap();
        insert_all(&e, &all);
        // Killed when the survivor says so; then this one answers it.
        line.clear();
        r.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "kill");
        rv.kill().unwrap();
        rv.wait().unwrap();
        writeln!(s, "killed").unwrap();
        answer_survivor(&e, R);
        let mut rest = Vec::new();
        let _ = r.read_to_end(&mut rest);
        return;
    }
    // The survivor S, with a local peer L that stays and a local victim LV.
    let (mut lp, mut l_lines, l_name) = spawn_peer("stay");
    let (mut lv, _lv_lines, lv_name) = spawn_peer("victim");
    let s = connect_to_node1(&peer, KILL_PORT);
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    writeln!(w, "{name} {l_name} {lv_name}").unwrap();
    let mut remote = String::new();
    r.read_line(&mut remote).unwrap();
    let all = format!("{name} {l_name} {lv_name} {}", remote.trim());
    insert_all(&e, &all);
    writeln!(lp.stdin.as_mut().unwrap(), "{all}").unwrap();
    writeln!(lv.stdin.as_mut().unwrap(), "{all}").unwrap();
    // Mid-stream: five messages from each victim, then both are killed.
    let rx = MemoryRegion::alloc(&e.domain, 4 << 20, Flags::RECV).unwrap();
    for v in [LV, RV] {
        for k in 0..5u64 {
            e.ep.trecv(RecvBuf::region(&rx, 0, 4096).unwrap(), v, STREAM, 0, 10 + k)
                .unwrap();
            let t = Instant::now();
            loop {
                let mut c = [CqEntry::default(); 1];
                let mut src = [0u64; 1];
                match e.cq.readfrom(&mut c, &mut src) {
                    Ok(1) => {
                        assert_eq!((c[0].op_context, src[0]), (10 + k, v));
                        break;
                    }
                    Ok(_) => {}
                    Err(err) if err.is_again() => {}
                    Err(err) => panic!("{err}: {:?}", e.cq.readerr()),
                }
                assert!(t.elapsed() < Duration::from_secs(60), "the victim's stream");
            }
        }
    }
    lv.kill().unwrap();
    lv.wait().unwrap();
    writeln!(w, "kill").unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "killed");
    // The others: every size from each, and one message to each.
    writeln!(lp.stdin.as_mut().unwrap(), "go").unwrap();
    let mut at = 0;
    let mut want = Vec::new();
    for p in [L, R] {
        for (k, &n) in SIZES.iter().enumerate() {
            e.ep.trecv(
                RecvBuf::region(&rx, at, n).unwrap(),
                p,
                AFTER,
                0,
                100 + want.len() as u64,
            )
            .unwrap();
            want.push((p, k, n, at));
            at += n;
        }
    }
    for p in [L, R] {
        post(&e, || e.ep.tsend(&pattern(64, p as u8), AFTER, p, 50 + p));
    }
    let mut got = vec![false; want.len()];
    let mut sends = 0;
    let t = Instant::now();
    while got.iter().any(|g| !g) || sends < 2 {
        let mut c = [CqEntry::default(); 8];
        let mut src = [0u64; 8];
        match e.cq.readfrom(&mut c, &mut src) {
            Ok(n) => {
                for (c, &from) in c[..n].iter().zip(&src) {
                    if c.flags & Flags::SEND.bits() != 0 {
                        sends += 1;
                        continue;
                    }
                    if c.tag == STREAM {
                        continue; // a victim's message still in flight when it died
                    }
                    let i = c.op_context as usize - 100;
                    let (p, k, n, at) = want[i];
                    assert_eq!((from, c.len), (p, n));
                    let mut b = vec![0u8; n];
                    rx.read_at(at, &mut b).unwrap();
                    assert!(b == pattern(n, seed_of(p as usize, 0, k)), "{n} B from {p}");
                    got[i] = true;
                }
            }
            Err(err) if err.is_again() => {}
            Err(err) => panic!("the survivor saw {err}: {:?}", e.cq.readerr()),
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "after the kills: {} of {} messages, {sends} of 2 sends",
            got.iter().filter(|g| **g).count(),
            got.len()
        );
    }
    assert!(l_lines
        .by_ref()
        .map_while(|l| l.ok())
        .any(|l| l.contains("PEER DONE")));
    writeln!(lp.stdin.as_mut().unwrap()).unwrap();
    assert!(lp.wait().unwrap().success());
    drop(w);
}
