//! Host-side paths: the software completion queue, EQ state and hint matching.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use rfabric::core::cq::{CqEntry, CqState};
use rfabric::core::info::Info;
use rfabric::{EpType, Flags};

fn cq_state(c: &mut Criterion) {
    c.bench_function("cq_state push+read 16", |b| {
        let mut s = CqState::new(1024);
        let mut out = [CqEntry::default(); 16];
        b.iter(|| {
            for i in 0..16 {
                s.push_entry(CqEntry {
                    op_context: i,
                    ..Default::default()
                })
                .unwrap();
            }
            black_box(s.read_into(&mut out).unwrap())
        })
    });
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
    c.bench_function("info mismatch+narrowed", |b| {
        b.iter(|| black_box(offered.mismatch(&h).is_none().then(|| offered.narrowed(&h))))
    });
}

criterion_group!(benches, cq_state, hints);
criterion_main!(benches);
