//! Host-side paths: what the fast path does besides the device's own work — building a
//! send work request, translating a work completion — and the software CQ and hint matching.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use rfabric::core::cq::{CqContextEntry, CqDataEntry, CqEntry, CqMsgEntry, CqState, FormatEntry};
use rfabric::core::info::Info;
use rfabric::core::srx::{Arrival, Filter, Kind, Recv, RxEngine};
use rfabric::verbs::cq::to_entry;
use rfabric::{EpType, Flags};
use rfabric_sys::verbs::{send_flags, wc_opcode, wc_status, SendWr, Sge, WorkCompletion};

fn work_requests(c: &mut Criterion) {
    let mut sge = Sge {
        addr: 0x1000,
        length: 64,
        lkey: 7,
    };
    c.bench_function("build send work request", |b| {
        b.iter(|| {
            let wr = SendWr::new(
                black_box(42),
                &mut sge,
                1,
                send_flags::SIGNALED | send_flags::INLINE,
                None,
            );
            black_box(wr.wr_id())
        })
    });
    let wcs: Vec<WorkCompletion> = (0..16)
        .map(|i| {
            let opcode = if i % 2 == 0 {
                wc_opcode::IBV_WC_SEND
            } else {
                wc_opcode::IBV_WC_RECV
            };
            WorkCompletion::new(i, wc_status::IBV_WC_SUCCESS, opcode, 64, None)
        })
        .collect();
    let mut out = [CqEntry::default(); 16];
    c.bench_function("translate 16 work completions", |b| {
        b.iter(|| {
            for (o, w) in out.iter_mut().zip(black_box(&wcs)) {
                *o = to_entry(w);
            }
            black_box(&out);
        })
    });
}

/// `cq_read` from the software queue: push 16 completions, read them in format `E`.
fn soft_read<E: FormatEntry>(c: &mut Criterion, name: &str) {
    c.bench_function(&format!("software CQ push+read 16, {name}"), |b| {
        let mut s = CqState::new(1024);
        let mut out = [E::default(); 16];
        b.iter(|| {
            for i in 0..16 {
                s.push_entry(CqEntry {
                    op_context: i,
                    ..Default::default()
                })
                .unwrap();
            }
            black_box(s.read_into(&mut out, None).unwrap())
        })
    });
}

fn cq_state(c: &mut Criterion) {
    soft_read::<CqContextEntry>(c, "FI_CQ_FORMAT_CONTEXT");
    soft_read::<CqMsgEntry>(c, "FI_CQ_FORMAT_MSG");
    soft_read::<CqDataEntry>(c, "FI_CQ_FORMAT_DATA");
    soft_read::<CqEntry>(c, "FI_CQ_FORMAT_TAGGED");
}

fn hints(c: &mut Criterion) {
    let mut offered = Info {
        caps: Flags::MSG | Flags::SEND | Flags::RECV,
        ..Default::default()
    };
    offered.ep_attr.ep_type = EpType::Msg;
    offered.tx_attr.size = 1 << 20;
    let mut h = Info {
        caps: Flags::MSG,
        ..Default::default()
    };
    h.ep_attr.ep_type = EpType::Msg;
    h.tx_attr.size = 128;
    c.bench_function("getinfo hint match and narrow", |b| {
        b.iter(|| black_box(offered.mismatch(&h).is_none().then(|| offered.narrowed(&h))))
    });
}

/// The shared receive engine: a receive matched to an arrival and freed, with `depth`
/// receives (or unexpected messages) from other sources ahead of it in the queue.
fn matching(c: &mut Criterion) {
    fn recv(addr: u64, context: u64) -> Recv<u64> {
        Recv {
            kind: Kind::Tag,
            from: Filter {
                addr,
                tag: context,
                ignore: 0,
            },
            buf: context,
            size: 4096,
            context,
            flags: Flags::empty(),
        }
    }
    for depth in [0usize, 64, 1024] {
        // Posted first: `depth` receives for source 1, then the one source 2 will match.
        let mut e = RxEngine::<u64>::new(depth + 8);
        for i in 0..depth {
            e.post(recv(1, i as u64), |_, _| {}).unwrap();
        }
        c.bench_function(&format!("match posted-first, {depth} ahead"), |b| {
            b.iter(|| {
                e.post(recv(2, 7), |_, _| {}).unwrap();
                let Ok(Arrival::Matched(m)) = e.arrive(Kind::Tag, black_box(2), 7, 64, 0) else {
                    panic!("no match")
                };
                e.free(m).unwrap();
            })
        });
        // Unexpected first: `depth` messages from source 1 wait, then one from source 2.
        let mut e = RxEngine::<u64>::new(depth + 8);
        for i in 0..depth {
            let Ok(Arrival::Unexpected(u)) = e.arrive(Kind::Tag, 1, i as u64, 64, 0) else {
                panic!("matched")
            };
            e.queue(u).unwrap();
        }
        c.bench_function(&format!("match unexpected-first, {depth} ahead"), |b| {
            b.iter(|| {
                let Ok(Arrival::Unexpected(u)) = e.arrive(Kind::Tag, black_box(2), 7, 64, 0) else {
                    panic!("matched")
                };
                e.queue(u).unwrap();
                let mut got = None;
                e.post(recv(2, 7), |_, id| got = Some(id)).unwrap();
                e.free(got.unwrap()).unwrap();
            })
        });
    }
}

criterion_group!(benches, work_requests, cq_state, hints, matching);
criterion_main!(benches);
