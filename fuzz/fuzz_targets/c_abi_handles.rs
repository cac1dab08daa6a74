//! Every C entry point of rverbs with hostile handles and arguments (issue 16): NULL,
//! zeroed, random and forged memory, other providers' objects of the same classes, closed
//! handles, double and out-of-order closes, lengths and counts up to `SIZE_MAX`, every flag
//! bit, contexts with the top byte set; and a misbehaving peer through the peer ops
//! (foreign and stale entries, double `free_entry`, failing `start_*`, huge error data,
//! calls after the owner closed). Each call must answer 0, a count or a documented
//! `-errno`: a crash, a sanitizer report, or a caught panic (`-FI_EOTHER`) fails.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rfabric::capi::harness::{call, documented, Choose, Pool};

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
        let rc = call(&mut pool, &mut c);
        assert!(documented(rc), "an undocumented answer {rc} (a caught panic is -FI_EOTHER)");
    }
});
