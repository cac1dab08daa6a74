//! `fi_getinfo` through rverbs' provider entry with hostile hints: every field of
//! `fi_info` and its attributes from the input, attributes present or NULL, node,
//! service and names that are not UTF-8, addresses of any bytes, and address lengths
//! that lie (past what any address is: the provider must refuse them before reading).
//! Every input must be answered with 0 or a documented error, never a crash or a panic.
#![no_main]

use std::ffi::CString;
use std::ptr;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use rfabric_sys::fabric as fi;

/// Lengths no address has: a provider that reads them reads past the caller's buffer.
const LYING_LENGTHS: [usize; 5] = [4097, 1 << 20, 1 << 40, isize::MAX as usize, usize::MAX];

struct Owned {
    strings: Vec<CString>,
    bytes: Vec<Vec<u8>>,
}

impl Owned {
    fn string(&mut self, u: &mut Unstructured<'_>) -> Result<*mut libc::c_char> {
        if !u.arbitrary::<bool>()? {
            return Ok(ptr::null_mut());
        }
        let raw: Vec<u8> = u.arbitrary()?;
        let s = CString::new(raw.into_iter().filter(|&b| b != 0).collect::<Vec<u8>>())
            .expect("no NUL left");
        self.strings.push(s);
        Ok(self.strings.last().unwrap().as_ptr() as *mut _)
    }

    /// An address buffer and the length declared for it.
    fn addr(&mut self, u: &mut Unstructured<'_>) -> Result<(*mut libc::c_void, usize)> {
        if !u.arbitrary::<bool>()? {
            return Ok((ptr::null_mut(), u.int_in_range(0..=64)?));
        }
        let b: Vec<u8> = u.arbitrary()?;
        let len = if u.ratio(1, 8)? {
            *u.choose(&LYING_LENGTHS)?
        } else {
            b.len()
        };
        self.bytes.push(b);
        Ok((self.bytes.last_mut().unwrap().as_mut_ptr().cast(), len))
    }
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let mut own = Owned {
        strings: Vec::new(),
        bytes: Vec::new(),
    };
    let node = own.string(u)?;
    let service = own.string(u)?;
    let flags: u64 = u.arbitrary()?;
    let version: u32 = u.arbitrary()?;
    // SAFETY: these C structs are plain data; zero is valid for each.
    let (mut tx, mut rx, mut ep, mut dom, mut fab, mut info): (
        fi::fi_tx_attr,
        fi::fi_rx_attr,
        fi::fi_ep_attr,
        fi::fi_domain_attr,
        fi::fi_fabric_attr,
        fi::fi_info,
    ) = unsafe { std::mem::zeroed() };
    tx.caps = u.arbitrary()?;
    tx.mode = u.arbitrary()?;
    tx.op_flags = u.arbitrary()?;
    tx.msg_order = u.arbitrary()?;
    tx.comp_order = u.arbitrary()?;
    tx.inject_size = u.arbitrary()?;
    tx.size = u.arbitrary()?;
    tx.iov_limit = u.arbitrary()?;
    tx.rma_iov_limit = u.arbitrary()?;
    rx.caps = u.arbitrary()?;
    rx.mode = u.arbitrary()?;
    rx.op_flags = u.arbitrary()?;
    rx.msg_order = u.arbitrary()?;
    rx.comp_order = u.arbitrary()?;
    rx.total_buffered_recv = u.arbitrary()?;
    rx.size = u.arbitrary()?;
    rx.iov_limit = u.arbitrary()?;
    ep.type_ = u.int_in_range(0..=8)?;
    ep.protocol = u.arbitrary()?;
    ep.max_msg_size = u.arbitrary()?;
    ep.msg_prefix_size = u.arbitrary()?;
    ep.tx_ctx_cnt = u.arbitrary()?;
    ep.rx_ctx_cnt = u.arbitrary()?;
    dom.name = own.string(u)?;
    dom.threading = u.int_in_range(0..=8)?;
    dom.control_progress = u.int_in_range(0..=4)?;
    dom.data_progress = u.int_in_range(0..=4)?;
    dom.resource_mgmt = u.int_in_range(0..=4)?;
    dom.av_type = u.int_in_range(0..=4)?;
    dom.mr_mode = u.arbitrary()?;
    dom.mr_key_size = u.arbitrary()?;
    dom.cq_data_size = u.arbitrary()?;
    dom.cq_cnt = u.arbitrary()?;
    dom.ep_cnt = u.arbitrary()?;
    dom.caps = u.arbitrary()?;
    dom.mode = u.arbitrary()?;
    dom.max_ep_tx_ctx = u.arbitrary()?;
    fab.name = own.string(u)?;
    fab.prov_name = own.string(u)?;
    fab.prov_version = u.arbitrary()?;
    fab.api_version = u.arbitrary()?;
    info.caps = u.arbitrary()?;
    info.mode = u.arbitrary()?;
    info.addr_format = u.int_in_range(0..=16)?;
    (info.src_addr, info.src_addrlen) = own.addr(u)?;
    (info.dest_addr, info.dest_addrlen) = own.addr(u)?;
    let attrs: u8 = u.arbitrary()?;
    info.tx_attr = if attrs & 1 != 0 { &mut tx } else { ptr::null_mut() };
    info.rx_attr = if attrs & 2 != 0 { &mut rx } else { ptr::null_mut() };
    info.ep_attr = if attrs & 4 != 0 { &mut ep } else { ptr::null_mut() };
    info.domain_attr = if attrs & 8 != 0 { &mut dom } else { ptr::null_mut() };
    info.fabric_attr = if attrs & 16 != 0 { &mut fab } else { ptr::null_mut() };
    let hints: *const fi::fi_info = if attrs & 32 != 0 { &info } else { ptr::null() };

    let prov = rfabric::capi::provider::fi_prov_ini();
    // SAFETY: the provider struct is static; getinfo is set.
    let getinfo = unsafe { (*prov).getinfo }.expect("getinfo");
    let mut out: *mut fi::fi_info = ptr::null_mut();
    // SAFETY: every pointer is NULL or valid for what it declares, except the lying
    // lengths, which rverbs must refuse before reading (what this target checks).
    let rc = unsafe { getinfo(version, node, service, flags, hints, &mut out) };
    assert!(
        rc != -(fi::FI_EOTHER as i32),
        "getinfo panicked inside (caught as -FI_EOTHER)"
    );
    assert!(rc <= 0, "getinfo returned {rc}");
    if rc == 0 {
        assert!(!out.is_null(), "getinfo returned 0 and no list");
        // SAFETY: rverbs allocates infos the way fi_freeinfo frees them.
        unsafe { fi::fi_freeinfo(out) };
    }
    Ok(())
}
