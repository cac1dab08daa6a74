//! A misbehaving peer provider through the owner's peer ops (issue 16's second harness):
//! `get_*`/`queue_*`/`free_entry` with entries it never got, stale ones, ones freed twice,
//! `start_*`/`discard_*` callbacks that fail, `writeerr` with `err_data_size` up to 2^64,
//! queries after the owner's AV closed, while the owner posts receives and closes its
//! objects under it. Each call must answer 0, a count or a documented `-errno`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rfabric::capi::harness::{call_peer, documented, Choose, Pool};

struct Bytes<'a>(&'a [u8], usize);

impl Choose for Bytes<'_> {
    fn pick(&mut self, n: usize) -> usize {
        if n <= 1 {
            return 0;
        }
        let b = self.0.get(self.1).copied().unwrap_or(0) as usize;
        self.1 += 1;
        b % n
    }
    fn word(&mut self) -> u64 {
        let mut w = [0u8; 8];
        for x in &mut w {
            *x = self.0.get(self.1).copied().unwrap_or(0);
            self.1 += 1;
        }
        u64::from_le_bytes(w)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut c = Bytes(data, 0);
    let mut pool = Pool::new(&mut c);
    while c.1 < data.len() {
        let rc = call_peer(&mut pool, &mut c);
        assert!(
            documented(rc),
            "an undocumented answer {rc} (a caught panic is -FI_EOTHER)"
        );
    }
});
